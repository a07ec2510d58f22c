//! Registering a run: `PUT /api/v1/runs/{run_id}` and its body.

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{InvalidBody, Path};
use crate::float::Float;
use crate::limits::{
    MAX_NAME_BYTES, MAX_PARAMS_PER_RUN, MAX_SHAPE_DIMS, MAX_TEXT_BYTES, MAX_WORLD_SIZE,
};
use crate::timestamp::Timestamp;
use crate::validate::{check_name, check_text};

/// A run's identifier, chosen by the client: `[A-Za-z0-9._-]{1,128}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct RunId(String);

impl RunId {
    pub fn parse(text: &str) -> Result<RunId, String> {
        if text.is_empty() || text.len() > 128 {
            return Err(format!(
                "run id must be 1 to 128 characters long, got {}",
                text.len()
            ));
        }
        if let Some(bad) = text
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(format!(
                "run id {text:?} contains {bad:?}: only letters, digits, '.', '_' and '-' are allowed"
            ));
        }
        if text == "." || text == ".." {
            return Err(format!("run id {text:?} is reserved"));
        }
        Ok(RunId(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for RunId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        RunId::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A floating-point format a parameter can be stored or computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F64,
    F32,
    F16,
    Bf16,
}

impl Dtype {
    /// Explicit bits of the significand (the implicit leading one not counted).
    pub fn mantissa_bits(self) -> u32 {
        match self {
            Dtype::F64 => 52,
            Dtype::F32 => 23,
            Dtype::F16 => 10,
            Dtype::Bf16 => 7,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// What a parameter is, for the detectors that care (norm weights, above all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Norm,
    Embedding,
    Linear,
    Bias,
    #[default]
    Other,
}

/// The loss scaler in use (torch.amp.GradScaler is `dynamic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum LossScaler {
    None,
    Static,
    Dynamic,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Precision {
    /// The dtype the optimizer updates (the master weights).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_dtype: Option<Dtype>,
    /// The forward dtype (autocast).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_dtype: Option<Dtype>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<LossScaler>,
}

/// The optimizer's hyper-parameters. Fields beyond the named ones (momentum,
/// nesterov, …) are kept as sent in `other`, since every optimizer has its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Optimizer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<[Float; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<Float>,
    /// v1.1: the optimizer's parameter groups (torch's `optimizer.param_groups`), each
    /// with its own hyper-parameters; a parameter names its group in `param_group`.
    /// A field a group leaves out falls back to the optimizer's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub param_groups: Vec<ParamGroup>,
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// v1.1: one parameter group of the optimizer (no weight decay on norms and biases, a
/// lower lr for a backbone, …). `name` is the client's: torch's group index as text
/// (`"0"`, `"1"`) unless the client has better names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ParamGroup {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<Float>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<[Float; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<Float>,
}

/// One parameter tensor of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ParamSpec {
    pub name: String,
    /// Defaults to `name` without its last dot-separated part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
    /// Defaults to the first dot-separated part of `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requires_grad: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_optimizer: Option<bool>,
    /// v1.1: the name of the optimizer parameter group (`optimizer.param_groups[].name`)
    /// that holds this parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_group: Option<String>,
    /// v1.4: how the parameter is laid out across the ranks of a multi-rank run
    /// (default `replicated`). `shape` stays the whole tensor's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
    /// v1.4: for a `sharded` parameter, the ranks whose shards together make it up
    /// (default: every rank of the run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_ranks: Option<Vec<u32>>,
}

/// v1.4: where a parameter's elements live in a multi-rank run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Every rank holds the whole tensor (data parallelism: DDP, or a parameter a
    /// sharding wrapper leaves whole); after the gradient all-reduce every rank's
    /// gradient is the same.
    #[default]
    Replicated,
    /// The elements are split across ranks (FSDP2 / ZeRO-3 `Shard(0)`, tensor
    /// parallelism): each rank reports its own shard, and the whole tensor's norm
    /// is the square root of the shards' summed squares.
    Sharded,
}

impl Layout {
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::Replicated => "replicated",
            Layout::Sharded => "sharded",
        }
    }
}

impl ParamSpec {
    /// The module this parameter belongs to (`module`, or `name` less its last part).
    pub fn module_name(&self) -> &str {
        match &self.module {
            Some(module) => module,
            None => default_module(&self.name),
        }
    }

    /// The coarse component (`group`, or the first dot-separated part of `name`).
    pub fn group_name(&self) -> &str {
        match &self.group {
            Some(group) => group,
            None => default_group(&self.name),
        }
    }

    pub fn role(&self) -> Role {
        self.role.unwrap_or_default()
    }

    /// Parameters are trainable unless they say otherwise.
    pub fn requires_grad(&self) -> bool {
        self.requires_grad.unwrap_or(true)
    }

    /// Parameters are in the optimizer unless they say otherwise.
    pub fn in_optimizer(&self) -> bool {
        self.in_optimizer.unwrap_or(true)
    }

    /// Parameters are replicated unless they say otherwise.
    pub fn layout(&self) -> Layout {
        self.layout.unwrap_or_default()
    }

    /// Elements of the whole tensor, when its shape is known.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .as_ref()
            .map(|shape| shape.iter().copied().fold(1u64, u64::saturating_mul))
    }
}

/// The group a module or parameter name falls in when none is given: its first
/// dot-separated part (`qwen.layers.0.mlp` → `qwen`).
pub fn default_group(name: &str) -> &str {
    name.split('.').next().unwrap_or(name)
}

/// The module a parameter belongs to when none is given: its name without the last
/// dot-separated part (`qwen.norm.weight` → `qwen.norm`); a name without dots is its
/// own module.
pub fn default_module(name: &str) -> &str {
    match name.rsplit_once('.') {
        Some((module, _)) => module,
        None => name,
    }
}

/// Per-run overrides of the server's detector thresholds, in steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DetectorOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stuck_zero_steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_norm_steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow_streak_steps: Option<u32>,
    /// `grad_explosion`: how many times its usual level a group's norm must stay
    /// over a few readings (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explosion_factor: Option<u32>,
    /// `grad_explosion`: how many times its usual level one reading must be to open
    /// at once (default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explosion_spike_factor: Option<u32>,
    /// `loss_divergence`: how many times its starting level the loss must stay over
    /// a few steps (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence_factor: Option<u32>,
}

/// The body of `PUT /api/v1/runs/{run_id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RunRegistration {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<Optimizer>,
    pub params: Vec<ParamSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detectors: Option<DetectorOverrides>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
    /// v1.1: the groups meant to train. A listed group with no trainable parameter,
    /// or whose parameters never change, is an alert; unlisted groups may be frozen
    /// on purpose. Absent: the client does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<Vec<String>>,
    /// v1.3: where the server POSTs this run's alerts as they open and resolve, besides
    /// the server's own `--webhook`s. Absent: only those.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub webhooks: Vec<Webhook>,
    /// v1.5: what the client found wrong in the model's wiring (see [`crate::wiring`]).
    /// Absent: nothing found, or a client that does not look.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wiring: Vec<crate::wiring::WiringFinding>,
    /// v1.8: which instability signals the client measures, each family with its
    /// interval in reported steps. Absent: none of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<crate::signals::SignalIntervals>,
    /// v1.9: how many of the model's modules are PyTorch's own whose behaviour depends
    /// on the training flag (dropout with `p > 0`, batch or instance norm keeping
    /// running statistics, recurrent layers and attention with dropout). `0` says the
    /// model holds none, so eval mode changes nothing PyTorch knows of. Absent: the
    /// client does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_dependent_modules: Option<u32>,
}

/// Most webhooks one registration may name.
pub const MAX_WEBHOOKS_PER_RUN: usize = 8;
/// Longest webhook URL, in bytes.
pub const MAX_WEBHOOK_URL_BYTES: usize = 2_048;

/// v1.3: a receiver of a run's alert notifications.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Webhook {
    /// An `http://` or `https://` URL that accepts a JSON `POST`.
    pub url: String,
    /// The body's shape (default `generic`).
    #[serde(default, skip_serializing_if = "WebhookFormat::is_generic")]
    pub format: WebhookFormat,
    /// The least severe alert sent (default `warning`: the `info` hints of a run's
    /// first steps stay on the dashboard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_severity: Option<AlertSeverity>,
}

/// The body a webhook receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    /// `{"event": "alert.opened" | "alert.resolved", "alert": {...}, ...}`.
    #[default]
    Generic,
    /// `{"text": "..."}`, what Slack's (and Mattermost's, and Discord's `/slack`)
    /// incoming webhooks take.
    Slack,
}

impl WebhookFormat {
    fn is_generic(&self) -> bool {
        *self == WebhookFormat::Generic
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WebhookFormat::Generic => "generic",
            WebhookFormat::Slack => "slack",
        }
    }
}

crate::vocabulary! {
    /// An alert's severity, most severe first.
    pub enum AlertSeverity {
        Critical = "critical",
        Warning = "warning",
        Info = "info",
    }
}

#[cfg(feature = "openapi")]
crate::vocabulary_schema!(AlertSeverity);

/// `scheme://host[:port]` of a webhook URL: what may be shown of it, since webhook
/// URLs (Slack's, for one) carry their secret in the path or query.
pub fn redact_webhook_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    format!("{scheme}://{authority}")
}

/// Checks a webhook URL: `http` or `https`, a host, no credentials in it, no
/// whitespace or control characters, within the length limit. A full URL parser
/// stays out of this crate; the server parses it again before sending.
pub fn check_webhook_url(url: &str) -> Result<(), String> {
    if url.len() > MAX_WEBHOOK_URL_BYTES {
        return Err(format!(
            "{} bytes is longer than the limit of {MAX_WEBHOOK_URL_BYTES}",
            url.len()
        ));
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| format!("{url:?} is not an http:// or https:// URL"))?;
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "{url:?} contains whitespace or a control character"
        ));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err("credentials in the URL are not accepted: put a token in its path or query, as Slack's webhook URLs do".to_owned());
    }
    let host = authority
        .rsplit_once(':')
        .filter(|(_, port)| !port.contains(']'))
        .map_or(authority, |(host, _)| host);
    if host.is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    Ok(())
}

impl RunRegistration {
    /// Parses and validates a registration body.
    pub fn from_json(body: &[u8]) -> Result<RunRegistration, InvalidBody> {
        let registration: RunRegistration = crate::located::json_with_path(body, "")?;
        registration.validate()?;
        Ok(registration)
    }

    /// Parses and validates a CBOR registration body (`application/cbor`).
    pub fn from_cbor(body: &[u8]) -> Result<RunRegistration, InvalidBody> {
        let registration: RunRegistration = crate::located::cbor_with_path(body, "")?;
        registration.validate()?;
        Ok(registration)
    }

    /// Checks what serde's types cannot say: name rules, uniqueness, ranges.
    pub fn validate(&self) -> Result<(), InvalidBody> {
        let root = Path::root("");
        if let Some(name) = &self.name {
            check_text(&root.field("name"), name, MAX_TEXT_BYTES)?;
        }
        if let Some(host) = &self.host {
            check_text(&root.field("host"), host, MAX_TEXT_BYTES)?;
        }
        if self.world_size == Some(0) {
            return Err(root
                .field("world_size")
                .error("world_size must be at least 1"));
        }
        if let Some(world_size) = self.world_size
            && world_size > MAX_WORLD_SIZE
        {
            return Err(root.field("world_size").error(format!(
                "world_size {world_size} is more than the limit of {MAX_WORLD_SIZE}"
            )));
        }
        if let (Some(rank), Some(world_size)) = (self.rank, self.world_size)
            && rank >= world_size
        {
            return Err(root
                .field("rank")
                .error(format!("rank {rank} is not below world_size {world_size}")));
        }
        if let Some(optimizer) = &self.optimizer {
            validate_optimizer(&root.field("optimizer"), optimizer)?;
        }
        if let Some(detectors) = &self.detectors {
            let path = root.field("detectors");
            for (field, value) in [
                ("stuck_zero_steps", detectors.stuck_zero_steps),
                ("frozen_norm_steps", detectors.frozen_norm_steps),
                ("overflow_streak_steps", detectors.overflow_streak_steps),
                ("explosion_factor", detectors.explosion_factor),
                ("explosion_spike_factor", detectors.explosion_spike_factor),
                ("divergence_factor", detectors.divergence_factor),
            ] {
                if value == Some(0) {
                    return Err(path
                        .field(field)
                        .error(format!("{field} must be at least 1")));
                }
            }
        }
        if let Some(signals) = &self.signals {
            signals.validate(&root.field("signals"))?;
        }
        validate_params(&root.field("params"), &self.params)?;
        crate::wiring::validate_wiring(&root.field("wiring"), &self.wiring)?;
        check_shard_ranks(&root.field("params"), &self.params, self.world_size())?;
        if let Some(train) = &self.train {
            let path = root.field("train");
            for (i, group) in train.iter().enumerate() {
                check_name(&path.index(i), group)?;
            }
        }
        let path = root.field("webhooks");
        if self.webhooks.len() > MAX_WEBHOOKS_PER_RUN {
            return Err(path.error(format!(
                "{} webhooks are more than the limit of {MAX_WEBHOOKS_PER_RUN}",
                self.webhooks.len()
            )));
        }
        for (i, webhook) in self.webhooks.iter().enumerate() {
            check_webhook_url(&webhook.url)
                .map_err(|message| path.index(i).field("url").error(message))?;
            if self.webhooks[..i].iter().any(|w| w.url == webhook.url) {
                return Err(path
                    .index(i)
                    .field("url")
                    .error("the same URL is listed twice"));
            }
        }
        Ok(())
    }

    /// Ranks in the run: `world_size`, 1 when absent.
    pub fn world_size(&self) -> u32 {
        self.world_size.unwrap_or(1)
    }

    /// The registration as it may be shown to readers: webhook URLs cut to their
    /// scheme, host and port.
    pub fn redacted(mut self) -> RunRegistration {
        for webhook in &mut self.webhooks {
            webhook.url = redact_webhook_url(&webhook.url);
        }
        self
    }

    /// The registration with the protocol's defaults written out (`module` and
    /// `group` of each parameter), as the server stores and shows it.
    pub fn normalized(mut self) -> RunRegistration {
        for param in &mut self.params {
            if param.module.is_none() {
                param.module = Some(default_module(&param.name).to_owned());
            }
            if param.group.is_none() {
                param.group = Some(default_group(&param.name).to_owned());
            }
        }
        self
    }
}

fn validate_optimizer(path: &Path<'_>, optimizer: &Optimizer) -> Result<(), InvalidBody> {
    if let Some(name) = &optimizer.name {
        check_text(&path.field("name"), name, MAX_NAME_BYTES)?;
    }
    check_hyper_parameters(
        path,
        optimizer.lr,
        optimizer.eps,
        optimizer.weight_decay,
        optimizer.betas,
    )?;
    validate_param_groups(&path.field("param_groups"), &optimizer.param_groups)
}

/// Checks a list of parameter specs: names, shapes, uniqueness within the list.
pub(crate) fn validate_params(path: &Path<'_>, params: &[ParamSpec]) -> Result<(), InvalidBody> {
    if params.len() > MAX_PARAMS_PER_RUN {
        return Err(path.error(format!(
            "{} parameters is more than the limit of {MAX_PARAMS_PER_RUN}",
            params.len()
        )));
    }
    let mut seen = HashSet::with_capacity(params.len());
    for (i, param) in params.iter().enumerate() {
        let path = path.index(i);
        check_name(&path.field("name"), &param.name)?;
        for (field, value) in [
            ("module", &param.module),
            ("group", &param.group),
            ("param_group", &param.param_group),
        ] {
            if let Some(value) = value {
                check_name(&path.field(field), value)?;
            }
        }
        if let Some(shape) = &param.shape
            && shape.len() > MAX_SHAPE_DIMS
        {
            return Err(path.field("shape").error(format!(
                "{} dimensions is more than the limit of {MAX_SHAPE_DIMS}",
                shape.len()
            )));
        }
        if !seen.insert(param.name.as_str()) {
            return Err(path
                .field("name")
                .error(format!("parameter {:?} is listed twice", param.name)));
        }
        if let Some(ranks) = &param.shard_ranks {
            let path = path.field("shard_ranks");
            if param.layout() != Layout::Sharded {
                return Err(path.error("shard_ranks is only for a parameter with layout sharded"));
            }
            if ranks.is_empty() {
                return Err(path.error("shard_ranks must name at least one rank"));
            }
            for (j, rank) in ranks.iter().enumerate() {
                if ranks[..j].contains(rank) {
                    return Err(path.index(j).error(format!("rank {rank} is listed twice")));
                }
            }
        }
    }
    Ok(())
}

fn check_shard_ranks(
    path: &Path<'_>,
    params: &[ParamSpec],
    world_size: u32,
) -> Result<(), InvalidBody> {
    match shard_rank_outside(params, world_size) {
        Some((i, j, message)) => Err(path.index(i).field("shard_ranks").index(j).error(message)),
        None => Ok(()),
    }
}

/// The first `params[i].shard_ranks[j]` that is not a rank of a run of `world_size`
/// ranks, as `(i, j, message)`: amendments are checked with it against the run's
/// registration.
pub fn shard_rank_outside(params: &[ParamSpec], world_size: u32) -> Option<(usize, usize, String)> {
    params.iter().enumerate().find_map(|(i, param)| {
        let (j, rank) = param
            .shard_ranks
            .iter()
            .flatten()
            .enumerate()
            .find(|(_, rank)| **rank >= world_size)?;
        Some((
            i,
            j,
            format!("rank {rank} is not below the run's world_size {world_size}"),
        ))
    })
}

/// Checks a list of parameter groups: names, uniqueness, hyper-parameter ranges.
pub(crate) fn validate_param_groups(
    path: &Path<'_>,
    groups: &[ParamGroup],
) -> Result<(), InvalidBody> {
    let mut names = HashSet::with_capacity(groups.len());
    for (i, group) in groups.iter().enumerate() {
        let path = path.index(i);
        check_name(&path.field("name"), &group.name)?;
        if !names.insert(group.name.as_str()) {
            return Err(path
                .field("name")
                .error(format!("parameter group {:?} is listed twice", group.name)));
        }
        check_hyper_parameters(&path, group.lr, group.eps, group.weight_decay, group.betas)?;
    }
    Ok(())
}

fn check_hyper_parameters(
    path: &Path<'_>,
    lr: Option<Float>,
    eps: Option<Float>,
    weight_decay: Option<Float>,
    betas: Option<[Float; 2]>,
) -> Result<(), InvalidBody> {
    for (field, value) in [("lr", lr), ("eps", eps), ("weight_decay", weight_decay)] {
        if let Some(value) = value
            && !(value.is_finite() && value.get() >= 0.0)
        {
            return Err(path.field(field).error(format!(
                "{field} must be a finite number ≥ 0, got {}",
                crate::format_float(value.get())
            )));
        }
    }
    if let Some(betas) = betas {
        for (i, beta) in betas.iter().enumerate() {
            if !(beta.is_finite() && (0.0..1.0).contains(&beta.get())) {
                return Err(path.field("betas").index(i).error(format!(
                    "betas must lie in [0, 1), got {}",
                    crate::format_float(beta.get())
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_follow_the_protocol_pattern() {
        for ok in ["r1", "qwen-agent_bf16.repro", &"a".repeat(128)] {
            assert!(RunId::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a/b",
            "..",
            ".",
            "a b",
            "r1;DROP TABLE runs",
            "é",
            &"a".repeat(129),
        ] {
            assert!(RunId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_come_from_the_name() {
        let param = ParamSpec {
            name: "qwen.layers.0.input_layernorm.weight".into(),
            module: None,
            group: None,
            role: None,
            dtype: None,
            shape: None,
            requires_grad: None,
            in_optimizer: None,
            param_group: None,
            layout: None,
            shard_ranks: None,
        };
        assert_eq!(param.module_name(), "qwen.layers.0.input_layernorm");
        assert_eq!(param.group_name(), "qwen");
        assert!(param.requires_grad() && param.in_optimizer());
        assert_eq!(default_module("bias"), "bias");
        assert_eq!(default_group("bias"), "bias");
    }

    #[test]
    fn the_protocol_example_parses() {
        let body = br#"{
          "name": "qwen-agent bf16 repro",
          "started_at": "2026-11-21T10:00:00Z",
          "host": "node-3", "rank": 0, "world_size": 1,
          "precision": {"param_dtype": "bf16", "compute_dtype": "bf16", "loss_scaler": "dynamic"},
          "optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
          "params": [
            {"name": "qwen.layers.0.input_layernorm.weight", "module": "qwen.layers.0.input_layernorm",
             "group": "qwen", "role": "norm", "dtype": "bf16", "shape": [896],
             "requires_grad": true, "in_optimizer": true}
          ],
          "detectors": {"stuck_zero_steps": 100},
          "config": {"anything": "free-form JSON, stored and shown as is"}
        }"#;
        let reg = RunRegistration::from_json(body).unwrap();
        assert_eq!(reg.params[0].role(), Role::Norm);
        assert_eq!(reg.precision.unwrap().param_dtype, Some(Dtype::Bf16));
    }

    #[test]
    fn invalid_registrations_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, ""),
            (
                r#"{"params": [{"name": "a", "dtype": "float32"}]}"#,
                "params[0].dtype",
            ),
            (
                r#"{"params": [{"name": "a"}, {"name": "a"}]}"#,
                "params[1].name",
            ),
            (r#"{"params": [{"name": ""}]}"#, "params[0].name"),
            (r#"{"params": [], "rank": 2, "world_size": 2}"#, "rank"),
            (
                r#"{"params": [], "detectors": {"stuck_zero_steps": 0}}"#,
                "detectors.stuck_zero_steps",
            ),
            (
                r#"{"params": [], "detectors": {"stuck_zero": 3}}"#,
                "detectors.stuck_zero",
            ),
            (
                r#"{"params": [], "optimizer": {"lr": "NaN"}}"#,
                "optimizer.lr",
            ),
            (r#"{"params": [], "nmae": "typo"}"#, "nmae"),
            (r#"{"params": [], "world_size": 65537}"#, "world_size"),
            (
                r#"{"params": [{"name": "a", "layout": "striped"}]}"#,
                "params[0].layout",
            ),
            (
                r#"{"params": [{"name": "a", "shard_ranks": [0]}]}"#,
                "params[0].shard_ranks",
            ),
            (
                r#"{"params": [{"name": "a", "layout": "sharded", "shard_ranks": []}]}"#,
                "params[0].shard_ranks",
            ),
            (
                r#"{"params": [{"name": "a", "layout": "sharded", "shard_ranks": [0, 0]}]}"#,
                "params[0].shard_ranks[1]",
            ),
            (
                r#"{"world_size": 2, "params": [{"name": "a", "layout": "sharded", "shard_ranks": [1, 2]}]}"#,
                "params[0].shard_ranks[1]",
            ),
        ];
        for (body, path) in cases {
            let err = RunRegistration::from_json(body.as_bytes()).unwrap_err();
            assert_eq!(&err.path, path, "{body}: {err}");
        }
    }

    #[test]
    fn a_multi_rank_registration_lays_its_parameters_out() {
        let reg = RunRegistration::from_json(
            br#"{"world_size": 4, "rank": 2, "params": [
                {"name": "a.weight", "layout": "sharded", "shape": [8, 4]},
                {"name": "b.weight", "layout": "sharded", "shard_ranks": [0, 1]},
                {"name": "c.weight"}]}"#,
        )
        .unwrap();
        assert_eq!(reg.world_size(), 4);
        assert_eq!(reg.params[0].layout(), Layout::Sharded);
        assert_eq!(reg.params[0].numel(), Some(32));
        assert_eq!(reg.params[2].layout(), Layout::Replicated);
        assert_eq!(
            shard_rank_outside(&reg.params, 2),
            None,
            "ranks 0 and 1 exist in a run of two"
        );
        assert_eq!(
            shard_rank_outside(&reg.params, 1).map(|(i, j, _)| (i, j)),
            Some((1, 1))
        );
    }

    #[test]
    fn webhooks_are_checked_where_they_are_wrong() {
        let ok = RunRegistration::from_json(
            br#"{"params": [], "webhooks": [
                {"url": "https://hooks.slack.com/services/T0/B0/x", "format": "slack"},
                {"url": "http://127.0.0.1:9000/alerts", "min_severity": "info"},
                {"url": "http://[::1]:9000/"}]}"#,
        )
        .unwrap();
        assert_eq!(ok.webhooks[0].format, WebhookFormat::Slack);
        assert_eq!(ok.webhooks[1].min_severity, Some(AlertSeverity::Info));
        // An old registration serializes as it did: no `webhooks` key.
        let old = RunRegistration::from_json(br#"{"params": []}"#).unwrap();
        assert!(!serde_json::to_string(&old).unwrap().contains("webhooks"));
        for (webhooks, path) in [
            (r#"[{"url": "ftp://example.com/"}]"#, "webhooks[0].url"),
            (r#"[{"url": "https://"}]"#, "webhooks[0].url"),
            (
                r#"[{"url": "https://user:pw@example.com/"}]"#,
                "webhooks[0].url",
            ),
            (r#"[{"url": "https://example.com/a b"}]"#, "webhooks[0].url"),
            (
                r#"[{"url": "https://a.example/"}, {"url": "https://a.example/"}]"#,
                "webhooks[1].url",
            ),
            (
                r#"[{"url": "https://a.example/", "format": "teams"}]"#,
                "webhooks[0].format",
            ),
            (
                r#"[{"url": "https://a.example/", "min_severity": "high"}]"#,
                "webhooks[0].min_severity",
            ),
        ] {
            let body = format!(r#"{{"params": [], "webhooks": {webhooks}}}"#);
            let err = RunRegistration::from_json(body.as_bytes()).unwrap_err();
            assert_eq!(err.path, path, "{body}: {err}");
        }
        let many: Vec<String> = (0..=MAX_WEBHOOKS_PER_RUN)
            .map(|i| format!(r#"{{"url": "https://a.example/{i}"}}"#))
            .collect();
        let body = format!(r#"{{"params": [], "webhooks": [{}]}}"#, many.join(","));
        let err = RunRegistration::from_json(body.as_bytes()).unwrap_err();
        assert_eq!(err.path, "webhooks", "{err}");
        // What readers are shown leaves the secret path out.
        let shown = ok.redacted();
        assert_eq!(shown.webhooks[0].url, "https://hooks.slack.com");
        assert_eq!(shown.webhooks[1].url, "http://127.0.0.1:9000");
        assert_eq!(redact_webhook_url("http://h:1/x?token=1#f"), "http://h:1");
    }
}
