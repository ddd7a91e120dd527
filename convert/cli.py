"""Command line of `python -m convert` (argument parsing, signals, one-line errors, exit codes)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

DESCRIPTION = """\
Convert a Hugging Face checkpoint directory (config.json + safetensors, single file or sharded with
model.safetensors.index.json; the Qwen3.6 multimodal wrapper layout or the text-only layout) into an
orbax checkpoint directory that jaxddtree.load_target / jaxddtree.load_drafter accept in place of the
HF directory. Vision-tower and MTP tensors are skipped. The same key maps and shape checks as the
loaders apply; weights are stored already transposed into the model's layout (same-input projections
fused into one matrix) and cast to --dtype, so loading does no transposes or casts (see NOTES.md,
"Converter", for restore timings).

Parameters are streamed one at a time (a fused one assembled from its tensors), so host memory stays
within a small multiple of the largest parameter. Output is written to a temporary directory next to
DST and renamed to DST only when complete: on any error or Ctrl-C nothing is left behind (an existing
DST is untouched) and the command exits non-zero with one line on stderr."""

EPILOG = """\
examples:
  python -m convert /models/Qwen3.6-27B /models/Qwen3.6-27B-jax
  python -m convert /models/drafter /models/drafter-jax --dtype bfloat16 --kind drafter

exit status: 0 success, 1 conversion error, 2 bad arguments (a missing or unusable SRC or DST too; one line,
before anything is read), 130 interrupted.
JAXDDTREE_CONVERT_DEBUG=1 shows the traceback of an unexpected error instead of one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        usage_error(message)


def usage_error(message: str):
    """A bad argument: one line on stderr, exit status 2."""
    print(f"convert: error: {message} (python -m convert --help)", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m convert", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="HF model directory to read (config.json + *.safetensors).")
    p.add_argument("dst", metavar="DST",
                   help="directory to create: orbax params/, config.json (copied from SRC, with tokenizer "
                        "files when present) and the marker jaxddtree_checkpoint.json.")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "bf16", "fp32"),
                   help="dtype the weights are stored in (default: bfloat16). Loading with the same dtype "
                        "is bit-identical to loading SRC; another dtype is cast on load.")
    p.add_argument("--kind", choices=("target", "drafter"), default=None,
                   help="what SRC holds: the Qwen3.5/3.6 target model or a DFlash drafter (default: "
                        "auto-detected from config.json; drafter configs have dflash_config/block_size).")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it exists (only an earlier converted checkpoint or an empty "
                        "directory is replaced; the swap happens after the new one is complete).")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar and no summary line (errors are still reported on stderr).")
    return p


def _quiet_libraries() -> None:
    """Keep stderr for our own single error line: no absl/orbax log lines, no library warnings."""
    import logging
    import warnings
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion is host work; never grab an accelerator
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.filterwarnings("ignore")
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.ERROR)
        absl_logging.set_stderrthreshold("error")
    except Exception:
        pass


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    _quiet_libraries()
    from jaxddtree.checkpoint.convert import ConvertError, Interrupted, check_paths, convert, one_line
    try:  # SRC / DST themselves (missing, not a directory, DST in the way): bad arguments, before any reading
        check_paths(os.path.abspath(args.src), os.path.abspath(args.dst.rstrip(os.sep) or args.dst), args.overwrite)
    except ConvertError as e:
        usage_error(one_line(e))

    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is not None:  # second Ctrl-C: stop right now
            raise KeyboardInterrupt
        stop["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    err = sys.stderr
    try:
        summary = convert(args.src, args.dst, dtype=args.dtype, kind=args.kind, overwrite=args.overwrite,
                          progress=not args.quiet, should_stop=lambda: stop["signal"] is not None)
    except Interrupted:
        print(f"convert: interrupted ({stop['signal'] or 'SIGINT'}); nothing written to {args.dst}", file=err)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print(f"convert: interrupted; nothing written to {args.dst}", file=err)
        return EXIT_INTERRUPTED
    except ConvertError as e:
        print(f"convert: error: {one_line(e)}", file=err)
        return EXIT_ERROR
    except MemoryError:
        print(f"convert: error: out of host memory while converting {args.src}", file=err)
        return EXIT_ERROR
    except Exception as e:  # unexpected (disk full, permissions, a bug): still one line, no traceback
        if os.environ.get("JAXDDTREE_CONVERT_DEBUG"):
            raise
        print(f"convert: error: {type(e).__name__}: {one_line(e)}", file=err)
        return EXIT_ERROR
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not args.quiet:
        mib = summary["num_bytes"] / 2**20
        print(f"wrote {summary['dst']}: {summary['kind']}, {summary['num_tensors']} tensors, {mib:.1f} MiB "
              f"{summary['dtype']}, {summary['seconds']:.1f} s")
    return 0
