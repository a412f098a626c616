"""Hardware datasheets: step-time coefficients and KV capacity, derived from published figures.

The one home of hardware facts: the calibration's starting constants
(:mod:`fastroute.predict.calibration`), the config's default hardware labels, the
controller's seed latencies, the engine emulator and the simulator all read them here.

Every coefficient of the calibrated step-time model (docs/algorithms.md §6.3)
is computed here from a GPU's datasheet numbers and a model's shape, so the
reasoning is code, not magic constants:

* ``b0`` (decode, per step) = weight bytes / effective memory bandwidth + a
  fixed per-step overhead (scheduler, kernel launches). Decoding streams every
  weight once per step; at small batch it is memory-bound.
* ``b1`` (decode, per sequence) = 2·params FLOPs / effective FLOP rate: the GEMM
  work each extra sequence adds.
* ``b2`` (decode, per context token) = KV bytes per token / effective
  bandwidth: attention reads the whole KV of every running sequence.
* ``a0`` (prefill, per step) = ``b0``: the weights are streamed once per step
  whatever the step does.
* ``a1`` (prefill, per new token) = 2·params FLOPs / effective FLOP rate.
* ``a2`` (prefill, per new token²) = causal attention among the new tokens:
  2·d_model·layers FLOPs per (query, key) pair ×2 matmuls / 2 (causal).
* ``a3`` (prefill, per new × cached token) = attention of new tokens to the
  cached prefix: 4·d_model·layers FLOPs per pair (not halved: no mask).

"Effective" = peak × an efficiency factor (``MEM_EFFICIENCY``, ``*_MFU``). The
efficiency factors are stated assumptions, typical of vLLM on these GPUs, not
measurements; a calibration fitted on real engines replaces them.

KV capacity follows vLLM's memory profiling: ``total × gpu_memory_utilization −
weights − non-torch memory − activation peak``; the remainder divided by KV
bytes per token (2·layers·kv_heads·head_dim·dtype bytes = 128 KiB for
Llama-3-8B in bf16), rounded down to whole blocks of 16 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "GpuSpec",
    "ModelSpec",
    "HardwareProfile",
    "GPUS",
    "LLAMA_3_8B",
    "QWEN_2_5_3B",
    "PROFILES",
    "derive_profile",
    "get_profile",
    "IDLE_LATENCY_S",
    "seed_latency_s",
    "BLOCK_SIZE_TOKENS",
]

#: vLLM's default KV block size, in tokens.
BLOCK_SIZE_TOKENS = 16
_GIB = 1024**3
_MIB = 1024**2

#: Fraction of peak memory bandwidth a decode step achieves (GEMV + paged attention).
MEM_EFFICIENCY = 0.8
#: Model FLOP utilisation of the dense GEMMs in prefill and batched decode.
GEMM_MFU = 0.5
#: FLOP utilisation of (flash) attention kernels.
ATTENTION_MFU = 0.4
#: Per-step fixed cost outside the GPU kernels: scheduling, input prep, launches (CUDA graphs).
STEP_OVERHEAD_S = 1.0e-3
#: vLLM's default ``gpu_memory_utilization``.
GPU_MEMORY_UTILIZATION = 0.9
#: Memory vLLM's profiling run reports outside torch (CUDA context, NCCL buffers).
NON_TORCH_BYTES = int(0.5 * _GIB)
#: Activation peak per token of the profiling batch (≈1.2 GiB at 8192 tokens for an 8B model).
ACTIVATION_BYTES_PER_BATCHED_TOKEN = 150 * 1024


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Published datasheet figures of one GPU.

    Attributes
    ----------
    name : str
        Short profile name (``"h100"``).
    description : str
        The exact part the figures belong to.
    memory_bytes : int
        Memory visible to CUDA (what ``nvidia-smi`` reports as total).
    bandwidth_Bps : float
        Peak memory bandwidth, bytes per second.
    bf16_flops : float
        Peak dense (no sparsity) bf16 tensor-core FLOP/s.
    default_max_num_batched_tokens : int
        vLLM V1's default token budget for the OpenAI server on this class of
        GPU (8192 when the GPU has ≥ 70 GiB, else 2048).
    """

    name: str
    description: str
    memory_bytes: int
    bandwidth_Bps: float
    bf16_flops: float
    default_max_num_batched_tokens: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a dense decoder-only model.

    Attributes
    ----------
    name : str
        Model family name.
    num_params : int
        Parameter count.
    num_layers, num_kv_heads, head_dim, hidden_size : int
        Transformer shape (GQA: ``num_kv_heads`` < attention heads).
    dtype_bytes : int
        Bytes per weight and per KV element (2 for bf16).
    max_model_len : int
        Context length served.
    """

    name: str
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype_bytes: int
    max_model_len: int

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights (params × dtype)."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


#: Meta Llama-3-8B (config.json: 32 layers, 8 KV heads, head_dim 128, hidden 4096), bf16.
LLAMA_3_8B = ModelSpec(
    name="llama-3-8b",
    num_params=8_030_261_248,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=4096,
    dtype_bytes=2,
    max_model_len=8192,
)

#: Qwen2.5-3B (config.json: 36 layers, 2 KV heads, head dim 128, hidden 2048), bf16: the
#: model of "Calibrate, Then Route" (docs/algorithms.md §6.1).
QWEN_2_5_3B = ModelSpec(
    name="qwen2.5-3b",
    num_params=3_085_938_688,
    num_layers=36,
    num_kv_heads=2,
    head_dim=128,
    hidden_size=2048,
    dtype_bytes=2,
    max_model_len=32768,
)

#: NVIDIA datasheet figures (dense bf16, i.e. half the "with sparsity" number).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", "H100 SXM5 80GB (HBM3)", 81559 * _MIB, 3.35e12, 989.4e12, 8192),
    "a100": GpuSpec("a100", "A100 SXM4 80GB (HBM2e)", 81920 * _MIB, 2.039e12, 312e12, 8192),
    "a40": GpuSpec("a40", "A40 48GB (GDDR6)", 46068 * _MIB, 696e9, 149.7e12, 2048),
    "l4": GpuSpec("l4", "L4 24GB (GDDR6)", 23034 * _MIB, 300e9, 121e12, 2048),
}


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Step-time coefficients and KV capacity of one (GPU, model) pair.

    Step times, in seconds (n new tokens, c cached/previously computed context,
    B decoding sequences, S their total context)::

        T_prefill(n, c) = a0 + a1·n + a2·n² + a3·n·c
        T_decode(B, S)  = b0 + b1·B + b2·S
        T_mixed         = T_decode(B, S) + Σ_chunks (a1·n + a2·n² + a3·n·c)

    Attributes
    ----------
    name : str
        Profile name (``"a40"``).
    model : ModelSpec
        The model served.
    gpu : GpuSpec
        The GPU the figures come from.
    a0_s, a1_s, a2_s, a3_s : float
        Prefill coefficients (s, s/token, s/token², s/token²).
    b0_s, b1_s, b2_s : float
        Decode coefficients (s, s/sequence, s/context token).
    kv_capacity_tokens : int
        KV-cache capacity, a whole number of blocks.
    default_max_num_batched_tokens : int
        Token budget per step unless configured.
    """

    name: str
    model: ModelSpec
    gpu: GpuSpec
    a0_s: float
    a1_s: float
    a2_s: float
    a3_s: float
    b0_s: float
    b1_s: float
    b2_s: float
    kv_capacity_tokens: int
    default_max_num_batched_tokens: int

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of the model (for transfer times)."""
        return self.model.kv_bytes_per_token

    @property
    def num_blocks(self) -> int:
        """KV capacity in blocks of :data:`BLOCK_SIZE_TOKENS`."""
        return self.kv_capacity_tokens // BLOCK_SIZE_TOKENS

    def prefill_time_s(self, n: int, c: int = 0) -> float:
        """Time of a prefill-only step computing ``n`` new tokens over ``c`` cached ones."""
        return self.a0_s + n * (self.a1_s + self.a2_s * n + self.a3_s * c)

    def decode_time_s(self, batch: int, context_tokens: int) -> float:
        """Time of a decode-only step of ``batch`` sequences holding ``context_tokens`` in all."""
        return self.b0_s + self.b1_s * batch + self.b2_s * context_tokens


def derive_profile(
    gpu: GpuSpec,
    model: ModelSpec = LLAMA_3_8B,
    *,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> HardwareProfile:
    """Derive a :class:`HardwareProfile` from datasheet figures (see the module docstring).

    Parameters
    ----------
    gpu : GpuSpec
        Datasheet figures.
    model : ModelSpec
        Model shape; Llama-3-8B by default.
    max_num_batched_tokens : int, optional
        Token budget the activation reserve is sized for; the GPU's vLLM default if omitted.
    gpu_memory_utilization : float
        Fraction of GPU memory vLLM may use.

    Returns
    -------
    HardwareProfile
    """
    budget = max_num_batched_tokens or gpu.default_max_num_batched_tokens
    eff_bw = gpu.bandwidth_Bps * MEM_EFFICIENCY
    gemm_flops = gpu.bf16_flops * GEMM_MFU
    attn_flops = gpu.bf16_flops * ATTENTION_MFU
    flops_per_token = 2.0 * model.num_params
    # Two matmuls (QKᵀ, AV) × 2 FLOPs per multiply-add × d_model × layers per (q, k) pair.
    attn_pair_flops = 4.0 * model.hidden_size * model.num_layers
    b0 = model.weight_bytes / eff_bw + STEP_OVERHEAD_S
    kv_bytes = (
        gpu.memory_bytes * gpu_memory_utilization
        - model.weight_bytes
        - NON_TORCH_BYTES
        - ACTIVATION_BYTES_PER_BATCHED_TOKEN * budget
    )
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit on {gpu.description}")
    kv_tokens = int(kv_bytes // model.kv_bytes_per_token)
    kv_tokens -= kv_tokens % BLOCK_SIZE_TOKENS
    return HardwareProfile(
        name=gpu.name,
        model=model,
        gpu=gpu,
        a0_s=b0,
        a1_s=flops_per_token / gemm_flops,
        a2_s=attn_pair_flops / 2.0 / attn_flops,  # causal mask: half the pairs
        a3_s=attn_pair_flops / attn_flops,
        b0_s=b0,
        b1_s=flops_per_token / gemm_flops,
        b2_s=model.kv_bytes_per_token / eff_bw,
        kv_capacity_tokens=kv_tokens,
        default_max_num_batched_tokens=budget,
    )


#: The built-in profiles: every GPU serving Llama-3-8B (named by the GPU: ``"a40"``) and
#: Qwen2.5-3B (``"a40-qwen2.5-3b"``), bf16.
PROFILES: dict[str, HardwareProfile] = {
    **{name: derive_profile(gpu) for name, gpu in GPUS.items()},
    **{
        f"{name}-{QWEN_2_5_3B.name}": replace(
            derive_profile(gpu, QWEN_2_5_3B), name=f"{name}-{QWEN_2_5_3B.name}"
        )
        for name, gpu in GPUS.items()
    },
}

#: Rough idle (TTFT₀, TBOT₀) in seconds of Llama-3-8B on each GPU at a typical request mix,
#: ordered by memory bandwidth (H100 fastest). Stated figures, not derived from the roofline
#: above: they seed latency profiles where only the ratios between GPUs and the shape matter
#: until profiles are fitted from signals.
IDLE_LATENCY_S: dict[str, tuple[float, float]] = {
    "h100": (0.05, 0.008),
    "a100": (0.08, 0.012),
    "a40": (0.15, 0.025),
    "l4": (0.25, 0.045),
}


def get_profile(name: str) -> HardwareProfile:
    """Return the built-in profile ``name``; raise ``KeyError`` naming the choices."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None


def seed_latency_s(name: str) -> tuple[float, float] | None:
    """Idle (TTFT₀, TBOT₀) in seconds of the built-in profile ``name``.

    Parameters
    ----------
    name : str
        A hardware label (case-insensitive).

    Returns
    -------
    tuple of float or None
        :data:`IDLE_LATENCY_S` of the profile's GPU; None when ``name`` is not a built-in
        profile or serves a model other than Llama-3-8B (the figures are for that model).
    """
    profile = PROFILES.get(name.lower())
    if profile is None or profile.model != LLAMA_3_8B:
        return None
    return IDLE_LATENCY_S.get(profile.gpu.name)
