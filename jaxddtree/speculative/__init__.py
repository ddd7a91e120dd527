"""Speculative decoding: DDTree tree building, acceptance and sampling (`tree`), tree verify and the commit
of the accepted path (`verify`), and the jit-compiled draft -> tree -> verify -> commit loop (`loop`)."""
