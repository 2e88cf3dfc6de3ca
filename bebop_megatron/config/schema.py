"""Typed configuration. Every field has a docstring; ``validate`` names the field it rejects.

Loaded by :func:`bebop_megatron.config.load_config` from the embedded defaults, an
optional YAML file and dotted ``key=value`` overrides (OmegaConf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    family: str = "dense"
    """``dense`` (Llama/Qwen2/Qwen3/MiMo shapes) or ``moe`` (Qwen3-MoE/GLM-4.5/DeepSeek-V3 shapes)."""
    num_layers: int = 4
    """Backbone decoder layers."""
    hidden_size: int = 128
    ffn_hidden_size: int = 384
    """Dense MLP width (SwiGLU; per gate/up half)."""
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    kv_channels: Optional[int] = None
    """Head dimension; default ``hidden_size // num_attention_heads``."""
    vocab_size: int = 512
    """The model's real vocabulary (a Hugging Face config's ``vocab_size``): token ids
    ``0 .. vocab_size-1``. The embedding and output layer are padded beyond it (see
    ``padded_vocab_size``); the loss, the acceptance statistics and evaluation mask the
    padded columns to -inf, as the serving engines never sample them."""
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: Optional[int] = None
    """Rows of the embedding and output layer. Default: ``vocab_size`` rounded up to a
    multiple of ``make_vocab_size_divisible_by * TP``. An import sets it (a multiple of
    ``make_vocab_size_divisible_by * 8``) so that one checkpoint loads at every TP dividing 8."""
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3); with ``multi_latent_attention``, RMSNorm
    on the query and key/value latents (DeepSeek-V3's ``q_a_layernorm`` / ``kv_a_layernorm``)."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    num_experts: int = 0
    """Routed experts (``moe`` family only)."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each routed expert; default ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert(s); None for no shared expert."""
    moe_token_dispatcher_type: str = "alltoall"
    """``alltoall`` or ``allgather``."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss on the MTP layers' routers (the backbone is frozen)."""
    moe_router_pre_softmax: bool = False
    """Router: softmax over all experts before the top-k (Qwen3-MoE with ``norm_topk_prob=false``);
    false takes the top-k logits and softmaxes them (= renormalised top-k probabilities)."""
    moe_router_score_function: str = "softmax"
    """``softmax`` or ``sigmoid`` (GLM-4.5 / DeepSeek-V3; sigmoid top-k scores are renormalised)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for the top-k choice only (``e_score_correction_bias``)."""
    moe_router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing (``n_group``); None: no groups."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may route to (``topk_group``)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the routed experts' weights (``routed_scaling_factor``)."""
    moe_first_dense_layers: int = 0
    """Leading backbone layers with a dense MLP of ``ffn_hidden_size`` (``first_k_dense_replace``)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions rotated by RoPE (GLM-4.5: 0.5; the first ones)."""
    multi_latent_attention: bool = False
    """Multi-Latent Attention (DeepSeek-V3) instead of GQA: queries and keys/values projected
    through low-rank latents; ``num_query_groups`` must equal ``num_attention_heads`` and
    ``kv_channels`` is ignored (the head widths are the fields below)."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query latent (``q_lora_rank``); None projects queries directly."""
    kv_lora_rank: Optional[int] = None
    """MLA: rank of the key/value latent (``kv_lora_rank``)."""
    qk_head_dim: Optional[int] = None
    """MLA: per-head query/key dimensions without RoPE (``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: Optional[int] = None
    """MLA: per-head query/key dimensions rotated by RoPE (``qk_rope_head_dim``; even)."""
    v_head_dim: Optional[int] = None
    """MLA: per-head value dimensions (``v_head_dim``)."""
    rope_type: str = "rope"
    """MLA only: ``rope`` (plain RoPE) or ``yarn`` (YaRN, DeepSeek-V3's long-context RoPE,
    with the ``yarn_*`` fields)."""
    yarn_scaling_factor: float = 1.0
    """YaRN ``factor``: context extension over ``yarn_original_max_position_embeddings``."""
    yarn_original_max_position_embeddings: int = 4096
    """YaRN ``original_max_position_embeddings`` (the pre-extension context)."""
    yarn_beta_fast: float = 32.0
    """YaRN ``beta_fast`` (rotations bounding the extrapolated dimensions)."""
    yarn_beta_slow: float = 1.0
    """YaRN ``beta_slow`` (rotations bounding the interpolated dimensions)."""
    yarn_mscale: float = 1.0
    """YaRN ``mscale``: cos/sin scaled by ``m(factor, mscale) / m(factor, mscale_all_dim)``."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN ``mscale_all_dim``: the softmax scale is multiplied by ``m(factor, mscale_all_dim)**2``."""
    layer_types: Optional[list[str]] = None
    """Per backbone layer: ``full_attention`` or ``linear_attention`` (Gated DeltaNet; Qwen3-Next /
    Qwen3.5 hybrids); None: every layer is full attention. The MTP layer is full attention."""
    attention_output_gate: bool = False
    """Gated attention (Qwen3-Next / Qwen3.5): the query projection also produces a per-head
    gate, and the attention output is multiplied by its sigmoid before the output projection."""
    zero_centered_norms: bool = False
    """Every RMSNorm computes ``x * (1 + w)`` (Qwen3-Next / Qwen3.5, MTP norms included); the
    Gated DeltaNet's gated norm follows it too (an import stores that norm's ``w - 1``)."""
    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet: width of the causal depthwise convolution over q, k and v."""
    linear_key_head_dim: int = 128
    """Gated DeltaNet: width of each query/key head."""
    linear_value_head_dim: int = 128
    """Gated DeltaNet: width of each value head."""
    linear_num_key_heads: int = 16
    """Gated DeltaNet: query/key heads (divisible by ``parallel.tensor``)."""
    linear_num_value_heads: int = 32
    """Gated DeltaNet: value heads (a multiple of ``linear_num_key_heads``)."""
    moe_shared_expert_gate: bool = False
    """Multiply the shared expert's output by ``sigmoid(x @ w)`` (Qwen3-Next / Qwen3.5-MoE)."""
    transformer_impl: str = "auto"
    """``auto`` (Transformer Engine when importable on CUDA, else local), ``local`` or ``transformer_engine``."""
    attention_backend: str = "sdpa"
    """Core attention of the local layers: ``sdpa`` (torch's fused ``scaled_dot_product_attention``:
    flash kernels on CUDA and CPU, memory linear in the sequence; packed rows run each document
    alone) or ``unfused`` (Megatron-Core's ``DotProductAttention``: ``S x S`` scores and mask per
    head, the reference). Same weights and checkpoints; ignored by Transformer Engine layers."""
    freeze_backbone: bool = True
    """Freeze embedding, decoder, final norm and output layer (the method). ``false`` trains
    the whole model on the same loss; only for comparisons (benchmarks, memory tests)."""
    backbone_checkpoint: Optional[str] = None
    """Megatron distributed checkpoint of the backbone (any parallel layout); None = random init
    (or, with ``backbone_init=fit_synthetic``, the fitted synthetic backbone)."""
    backbone_init: str = "random"
    """The backbone without a checkpoint: ``random`` (Megatron's seeded init: p is almost uniform)
    or ``fit_synthetic`` (the quick start's default): on synthetic data (no ``data.train_files``)
    the backbone is first fitted to the synthetic language, once, and cached under
    ``$BEBOP_MEGATRON_CACHE`` or ``~/.cache/bebop_megatron`` keyed by the model and data config
    (``bebop_megatron/training/synthetic_backbone.py``); the run then uses it as
    ``backbone_checkpoint``. Ignored with data files or a checkpoint."""
    init_checkpoint: Optional[str] = None
    """Megatron distributed checkpoint holding backbone *and* MTP weights to start from
    (e.g. one written by ``save_model_checkpoint`` or an imported MiMo/GLM model)."""


@dataclass
class MTPConfig:
    num_layers: int = 1
    """Distinct MTP layers; either ``num_steps`` or 1 (one layer reused for every step)."""
    num_steps: int = 3
    """MTP training steps K (prediction depth)."""
    detach_heads: bool = False
    """Megatron's ``mtp_detach_heads`` (detach head inputs)."""
    init: str = "auto"
    """How fresh MTP layers start (a new run; a resumed one restores its weights):
    ``identity`` (the draft starts as the backbone's own next-token distribution: eh_proj
    passes the hidden state through, the layer's output projections are zero), ``random``
    (Megatron's init), ``copy_last_layer`` (copies of the backbone's last layer and final
    norm), or ``auto``: the MTP weights of ``model.init_checkpoint`` when given, otherwise
    Megatron's init, the start measured to climb fastest on a real model
    (``benchmarks/real_model/RESULTS.md``)."""
    next_step_input: str = "post_norm"
    """What MTP step k hands to step k+1: its output after its final norm (``post_norm``:
    Megatron-Core's ``MultiTokenPredictionBlock``, and what current vLLM and SGLang drafts of
    every family compute; vLLM's DeepSeek-V3 / GLM-4.5 drafts since vLLM PR #45895, merged
    2026-06-19) or before it (``pre_norm``: the DeepSeek-V3 / GLM-4.5 drafts of vLLM releases
    before PR #45895; export those heads with ``convert_to_hf.py --vllm-handoff pre_norm``).
    Train with the serving engine's choice: it only matters from draft step 2 on, and export
    ``--verify`` fails at step 2 when it differs from the target's. Step 1 always gets the
    backbone's final-norm output; each step's logits always use its final norm."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: Optional[int] = None
    """Expert tensor parallel size; default equals ``tensor``."""
    context: int = 1
    sequence_parallel: bool = False
    pipeline_layout: Optional[str] = None
    """Megatron ``pipeline_model_parallel_layout`` string: ``E`` embedding, ``t`` decoder layer,
    ``m`` one MTP step (``mtp.num_steps`` of them), ``L`` loss, ``|`` between stages. E.g.
    ``"Et*4|m*3L"`` puts 4 layers on stage 0 and a standalone MTP stage (K=3) on stage 1.
    None places the MTP block on the last stage with the last decoder layers."""
    distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks. Fixed for a run: a resume that changes it is
    refused (the optimizer state is saved in another format)."""


@dataclass
class LossConfig:
    type: str = "e2e_nla"
    """MTP objective. Default ``e2e_nla``: -log(E[L]/K) per chain, the best of ``ce``, ``kl``,
    ``e2e_tv`` and ``e2e_nla`` on a real model both from a fresh head and from an existing ce
    head in the one study so far (``benchmarks/real_model/RESULTS_gpu.md``). The others:
    ``e2e_tv`` (Eq. 13, the paper's), ``tv`` (per-step TV, Eq. 10), ``kl`` (forward
    KL(p||q)), ``reverse_kl`` (KL(q||p)), the cold-start objectives (for heads that start from
    nothing) ``nla`` (-log alpha per step), ``lk`` (lambda KL + (1 - lambda) TV per step,
    lambda = exp(-lk_eta sg(alpha))), ``e2e_lk`` (the chain-level blend of KL and e2e TV), all
    against the frozen backbone's distribution over the full vocabulary; or ``ce``
    (cross-entropy on the data tokens, Megatron's default MTP loss)."""
    lk_eta: float = 3.0
    """eta of ``lk`` / ``e2e_lk``: lambda = exp(-lk_eta x the detached acceptance), so a larger
    eta hands over from KL to TV at a lower acceptance; > 0 (ignored by the other types)."""
    target_temperature: float = 1.0
    """Backbone logits are divided by it before the softmax; 0.001 to 1000."""
    draft_temperature: float = 1.0
    """Draft (MTP) logits are divided by it before the softmax; 0.001 to 1000."""
    chunk_tokens: int = 512
    """Tokens (sequence positions x micro-batch) per loss-kernel call: bounds the float32
    logits and temporaries to a few ``chunk_tokens x V_local`` buffers per MTP step."""
    impl: str = "torch"
    """Loss kernel: ``torch`` (chunked plain torch, any device) or ``triton`` (Triton kernels
    tiled over the vocabulary; CUDA only), for every ``type`` (``lk`` / ``e2e_lk`` take TV and
    KL of a row from one pass in both)."""


@dataclass
class DataConfig:
    train_files: list[Any] = field(default_factory=list)
    """Training sources; empty = the built-in synthetic data. Each entry is a path or
    ``{path: ..., weight: ...}`` (a blend: documents are drawn in proportion to the weights;
    give a weight for every entry or for none). A path is a JSONL file (``messages``,
    ``prompt``/``response`` or ``text`` per line, or token ids: see ``format``), a Parquet file
    (the same fields as columns; needs ``pip install 'bebop_megatron[parquet]'``), a slime rollout
    dump (``.pt``) or a Megatron indexed dataset written by
    ``tools/preprocess_data.py`` (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``). Relative
    paths are relative to the working directory. Without weights the files form one corpus.
    A single entry may be given without the list (``data.train_files=PATH``)."""
    valid_files: list[Any] = field(default_factory=list)
    """Validation sources, same form as ``train_files``; empty = no validation data."""
    format: str = "auto"
    """Layout of the records of the ``train_files``/``valid_files`` that are files (JSONL, Parquet
    or a slime torch dump): ``generic`` (``messages``, ``prompt``/``response``, ``text``, or token
    ids: ``input_ids`` with ``loss_mask`` or ``labels``, ``prompt_ids``/``response_ids``),
    ``verl`` (rollout dumps: ``input``/``output``), ``openrlhf`` (batch_inference output:
    ``input``/``output``), ``slime`` (saved rollout samples: ``tokens``, ``response_length``,
    ``loss_mask``); ``auto`` detects it per file from the first record and logs one line naming
    a non-generic layout. Token ids must lie below ``model.vocab_size``."""
    tokenizer: Optional[str] = None
    """Local Hugging Face tokenizer directory (loaded without network access); None = the
    built-in byte-level tokenizer (UTF-8 bytes plus a few special tokens)."""
    train_on: str = "response"
    """``response``: train only on response / assistant tokens (and the EOS after them);
    ``all``: every token. Untrained positions are invalid MTP targets, so chains stop there."""
    on_error: str = "fail"
    """Bad JSONL lines: ``fail`` stops before training with ``PATH:LINE: what is wrong``;
    ``skip`` skips them and reports how many were skipped and why."""
    pack: bool = True
    """Pack several documents into each row of ``train.seq_length`` (attention and MTP
    chains never cross documents: a per-document causal mask); ``false``: one document per
    row, padded (needed with Transformer Engine layers for now)."""
    overlong: str = "truncate"
    """Documents longer than ``train.seq_length + 1`` tokens: ``truncate`` (keep the first
    ``seq_length + 1``) or ``drop``; either way counted in one summary warning."""
    num_samples: int = 4096
    """Synthetic dataset size (samples of ``train.seq_length + 1`` tokens)."""
    markov_branching: int = 4
    """Synthetic data: successors per token in the generating Markov chain (lower = easier)."""
    markov_min_branching: Optional[int] = None
    """Synthetic data: when set, each token's number of successors is drawn log-uniformly from
    ``markov_min_branching .. markov_branching``, so the next-token entropy varies by token (as on
    real text); None: every token has ``markov_branching``. Values of 1 can create absorbing
    deterministic cycles: use >= 2."""
    seed: int = 1234
    """Synthetic data generation and the shuffle of real data (a new permutation per epoch)."""


@dataclass
class TrainConfig:
    steps: int = 50
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int = 64
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_schedule: str = "constant"
    """``constant`` (with warmup; the paper's recipe) or ``cosine`` (after the warmup, down to ``min_lr`` at the
    last step)."""
    warmup_fraction: float = 0.03
    """Fraction of ``steps`` spent in linear warmup: with W = round(warmup_fraction * steps), step
    n <= W trains at lr * n / W (the first at lr / W, never 0)."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    seed: int = 1234
    resume: str = "auto"
    """``auto``: continue from the newest complete checkpoint in ``save.dir`` if there is one
    (``latest``; if it is missing or names no complete checkpoint, the newest complete
    ``iter_N``, with a notice). The saved ``config.yaml`` is compared first: a changed field
    that defines the model, the backbone or the data is refused (``model.*`` and ``mtp.*``
    except ``model.transformer_impl``, ``model.attention_backend`` and ``mtp.init``; ``precision``
    except bf16<->fp8;
    ``train.seq_length``; ``data.train_files/tokenizer/train_on/pack/overlong/num_samples/
    markov_branching/markov_min_branching/seed``; ``train.seed`` with a random backbone;
    ``parallel.distributed_optimizer`` (its optimizer state is saved in another format); so is
    a backbone or ``data.train_files`` file changed under the same path (their fingerprints);
    see ``bebop_megatron/training/resume.py``). Other changes are listed in one line; a new LR
    schedule (``train.lr/min_lr/lr_schedule/warmup_fraction/weight_decay/steps``) applies from
    the resumed step on. ``none``: start at step 0; refused if ``save.dir`` already holds
    checkpoints, unless ``save.overwrite``."""
    log_interval: int = 1
    deterministic: bool = True
    """Deterministic algorithms (CPU runs are bit-reproducible)."""
    max_skipped_steps: int = 10
    """Numerics guard: a step whose loss or gradient is not finite is skipped (no update,
    counted and logged); this many consecutive skips abort the run (exit status 3)."""
    allow_beyond_max_positions: bool = False
    """Train with ``seq_length`` above ``model.max_position_embeddings`` (refused otherwise).
    RoPE is then applied unchanged at the positions past it (extrapolated: the same rotation
    formula, no interpolation or rescaling; YaRN keeps its configured factor), which the
    backbone never saw in its own training: its hidden states there, and draft heads fitted
    to them, may be out of distribution."""


@dataclass
class EvalConfig:
    interval: int = 0
    """Evaluate on ``data.valid_files`` every N training steps and after the last step
    (0: only after the last step). Ignored without ``data.valid_files``."""
    max_samples: int = 0
    """Validation rows (packed sequences) per evaluation: 0 = all of them."""


@dataclass
class SaveConfig:
    dir: Optional[str] = "checkpoints/tiny"
    """Checkpoint directory; None disables saving. Default: ``checkpoints/tiny`` for the
    embedded quick-start run; a run given ``--config FILE`` whose file does not set it gets
    ``checkpoints/<FILE's stem>`` (``examples/configs/tiny_moe_cpu.yaml`` ->
    ``checkpoints/tiny_moe_cpu``), never the quick-start's directory. Rank 0 holds the lock
    ``run.lock`` in it while the run lives: a second run on the same directory is refused."""
    interval: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (older ones are deleted after a save); 0 keeps all."""
    overwrite: bool = False
    """With ``train.resume=none``: delete the checkpoints already in ``dir`` (``iter_*``,
    ``latest``) and start over. Without it such a run is refused, so that it cannot overwrite
    another run's checkpoints and move ``latest`` back."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron-Core's async save, ``mcore`` strategy: a
    forked writer per save): training continues while the files are written; ``latest``
    moves once every rank has finished. Works on CPU (gloo) and CUDA."""


@dataclass
class FP8Config:
    recipe: str = "delayed"
    """Transformer Engine FP8 scaling recipe for ``precision=fp8`` (backbone forward and MTP
    layers; the loss stays float32): ``delayed`` (scales from an amax history), ``tensorwise``
    (current per-tensor scaling), ``blockwise`` (1x128 / 128x128 block scales, Hopper) or
    ``mxfp8`` (MX block-32 scaling, Blackwell only)."""
    format: str = "hybrid"
    """``hybrid`` (E4M3 activations and weights, E5M2 gradients) or ``e4m3`` (E4M3 everywhere)."""
    amax_history_len: int = 1024
    """``delayed`` recipe: amax values kept per tensor to choose its scale."""
    amax_compute_algo: str = "max"
    """``delayed`` recipe: ``max`` (over the history) or ``most_recent``."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """``online`` (streams to the wandb server), ``offline`` (writes a run directory to sync
    later with ``wandb sync``) or ``disabled``. Needs ``pip install -e '.[wandb]'``."""
    project: str = "bebop_megatron"
    name: Optional[str] = None
    """Run name; None lets wandb choose one."""
    dir: Optional[str] = None
    """Parent of the ``wandb/`` run directories; None = ``save.dir`` (or the working directory)."""


@dataclass
class LoggingConfig:
    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory (``tensorboard --logdir DIR``); None disables TensorBoard."""
    metrics_file: Optional[str] = None
    """JSONL file: one line ``{"step": N, name: value, ...}`` per logged step and held-out pass
    (the TensorBoard scalar names), appended and flushed as they come (a resumed run
    continues the file); None: not written."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device, for MFU; None: known from the GPU name (H100/H200,
    A100, B200; bf16, doubled for fp8), otherwise MFU is not reported (e.g. on CPU)."""


@dataclass
class Config:
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` (gloo backend) or ``cuda`` (NCCL)."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp8`` (fp8 needs Transformer Engine on an FP8-capable GPU)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
