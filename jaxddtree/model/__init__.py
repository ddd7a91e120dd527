"""The models: configuration, the layers of the Qwen3.5/3.6 hybrid target (gated attention, Gated DeltaNet,
MLP, norms, RoPE, projections), their caches, the token layouts that describe a pass (sequence or tree),
the target (`Target`: split once, jitted passes), the DFlash drafter, and the chunked prefill."""
