"""The wire format, as ``TypedDict``s mirroring the protocol crate.

Each type names the Rust struct it mirrors (``protocol/src/step.rs``, ``run.rs``,
``amend.rs``; docs/PROTOCOL.md describes them). Optional fields are left out of a
record rather than sent as null, except where the protocol gives null a meaning (a
module's ``grad_norm``: no gradient this step). Non-finite numbers travel as the
strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (:mod:`gradflow.measurement.encode`).
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, TypedDict, Union

Float = Union[float, str]
"""A protocol ``Float``: a JSON number, or "NaN", "Infinity", "-Infinity"."""


# -- step records (protocol/src/step.rs) ---------------------------------------------


class CallSite(TypedDict, total=False):
    """``CallSite``: a frame of the user's code."""

    file: str
    line: int
    function: str


class GraphCut(TypedDict, total=False):
    """``GraphCut``: a watched module's forward that ran cut from backward."""

    module: str
    kind: str  # GraphCutKind: "no_grad", "detached_input", ...
    group: str
    upstream: str
    stack: List[CallSite]
    via: str  # GraphCutVia (v1.6): "reentrant_checkpoint"


class _ModuleStepName(TypedDict):
    module: str


class AdamState(TypedDict, total=False):
    """``AdamState`` (``protocol/src/signals.rs``, v1.8): Adam's state over a module's
    own parameters, on sampled steps."""

    updated: int
    below_eps: float
    update_rms: Optional[Float]
    update_absmax: Optional[Float]


class ModuleStep(_ModuleStepName, total=False):
    """``ModuleStep``: one module's gradient on one step."""

    grad_norm: Optional[Float]
    hook_hits: int
    grad_sumsq: Optional[Float]  # multi-rank runs: this rank's partial sum
    numel: int
    nonfinite: int
    param_sum: Float  # multi-rank runs, now and then: the sum of this rank's weights
    attn_max_logit: Float  # v1.8, attention modules
    attn_min_entropy: Optional[Float]  # v1.8
    act_rms: Optional[Float]  # v1.8, blocks
    act_absmax: Optional[Float]  # v1.8
    adam: AdamState  # v1.8, sampled steps


class OutputLogits(TypedDict, total=False):
    """``OutputLogits`` (v1.8)."""

    logz_mean: Float
    absmax: Optional[Float]
    logit_mean: Float  # v1.9


class _MoeLayerName(TypedDict):
    module: str
    tokens_per_expert: List[int]


class MoeLayer(_MoeLayerName, total=False):
    """``MoeLayer`` (v1.8): one MoE layer's routing on one step."""

    router_z: Optional[Float]


class BatchInfo(TypedDict, total=False):
    """``BatchInfo`` (v1.8): what the step trained on."""

    ids: List[str]
    micro_losses: List[Float]
    repeated_token_share: Float  # v1.9


class _ParamStepName(TypedDict):
    name: str


class ParamStep(_ParamStepName, total=False):
    """``ParamStep``: a norm weight's or low-precision parameter's numbers."""

    grad_norm: Optional[Float]
    update_norm: Optional[Float]
    drift: Optional[Float]
    mean: Float
    intended_update_norm: Optional[Float]
    intended_update_max_ulp: Optional[Float]
    intended_nonzero: int
    rounded_away: int
    numel: int


class ScalerState(TypedDict, total=False):
    """``ScalerState``: the loss scaler before ``update()``."""

    scale: Optional[Float]
    growth_tracker: int
    found_inf: bool
    step_skipped: bool


class ParamGroup(TypedDict, total=False):
    """``ParamGroup``: an optimizer parameter group."""

    name: str
    lr: float
    weight_decay: float
    betas: List[float]
    eps: float


class Precision(TypedDict, total=False):
    """``Precision``."""

    param_dtype: str
    compute_dtype: str
    loss_scaler: str  # "none", "static", "dynamic"


class ParamSpec(TypedDict, total=False):
    """``ParamSpec``: a parameter as registered."""

    name: str
    module: str
    group: str
    role: str
    dtype: str
    shape: List[int]
    requires_grad: bool
    in_optimizer: bool
    param_group: str
    layout: str
    shard_ranks: List[int]


class Amendment(TypedDict, total=False):
    """``Amendment`` (``protocol/src/amend.rs``): what changed since registration."""

    params: List[ParamSpec]
    param_groups: List[ParamGroup]
    precision: Precision
    wiring: List[WiringFinding]  # v1.5: findings made once training ran


class _StepNumber(TypedDict):
    step: int


class StepRecord(_StepNumber, total=False):
    """``StepRecord``: one optimizer step of one process."""

    time: float
    loss: Float
    lr: float
    lrs: Dict[str, float]
    modules: List[ModuleStep]
    params: List[ParamStep]
    scaler: ScalerState
    metrics: Dict[str, Optional[Float]]
    dropped_steps: int
    amend: Amendment
    graph_cuts: List[GraphCut]
    grads_carried_over: bool
    input_absmax: Optional[Float]
    rank: int
    step_time: float
    local_grads_nonfinite: bool  # v1.7
    output_logits: OutputLogits  # v1.8
    moe: List[MoeLayer]  # v1.8
    batch: BatchInfo  # v1.8
    optimizer_steps: int  # v1.9


# -- registration (protocol/src/run.rs) ----------------------------------------------


class Webhook(TypedDict, total=False):
    """``Webhook``."""

    url: str
    format: str
    min_severity: str


class Optimizer(TypedDict, total=False):
    """``Optimizer``; other keys are kept as the optimizer's own settings."""

    name: str
    lr: float
    betas: List[float]
    eps: float
    weight_decay: float
    param_groups: List[ParamGroup]


class _WiringKind(TypedDict):
    # freeze_flag_ignored | modules_not_registered | tied_weights_untied |
    # params_created_in_forward | (v1.6) clip_before_unscale | clip_after_step |
    # scheduler_per_micro_batch | param_group_empty | (v1.9) tensors_not_registered |
    # (v1.10) plateau_mode_mismatch | frozen_weights_stepped | loss_broadcasts
    kind: str
    module: str


class WiringFinding(_WiringKind, total=False):
    """``WiringFinding`` (``protocol/src/wiring.rs``, v1.5)."""

    attribute: str
    params: int
    measured: int  # v1.6
    bound: float  # v1.11: a clip before backward's max_norm or clip_value
    used_norms: List[float]  # v1.11: the sizes of the gradients the steps used, above it


class RunRegistration(TypedDict, total=False):
    """``RunRegistration``: the body of ``PUT /api/v1/runs/{id}``."""

    name: str
    started_at: float
    host: str
    rank: int
    world_size: int
    precision: Precision
    optimizer: Optimizer
    params: List[ParamSpec]
    detectors: Dict[str, int]
    config: Any
    train: List[str]
    webhooks: List[Webhook]
    wiring: List[WiringFinding]
    signals: Dict[str, int]  # v1.8: family -> interval in reported steps
    mode_dependent_modules: int  # v1.9: PyTorch modules that read the training flag


# -- what the server answers ---------------------------------------------------------


class Alert(TypedDict, total=False):
    """An alert as ``GET /api/v1/runs/{id}/alerts`` returns it."""

    id: int
    kind: str
    subject: str
    severity: str  # "info", "warning", "critical"
    status: str
    title: str
    detail: str
    fix: str
    opened_step: Optional[int]
    evidence: Dict[str, Any]
