//! `grad_stuck_zero`: a group or module with trainable parameters whose gradient norm
//! is exactly 0, or absent, on N consecutive reported steps.
//!
//! The case behind it: a hybrid model whose Qwen part trained for hours at
//! `Qwen_grad: 0.00e+00` because a stray `torch.no_grad()` or `.detach()` cut the
//! graph. Healthy patterns stay silent by construction: a zero on step 0 only is a
//! streak of one, and a model that back-propagates into Qwen every 10th step (prompt
//! caching) never gets past nine.
//!
//! One root cause, one alert. A whole group stuck is one alert on the group. When
//! more than [`MAX_MODULE_ALERTS`] modules of a group that is not stuck as a whole
//! reach the threshold on the same step for the same cause (a cut below a shared
//! embedding, a frozen tower inside a larger group), they are one alert on their
//! common name prefix, listing them. Modules are named individually only when a few
//! dead modules sit inside a healthy group.
//!
//! A client that watches the forward pass (the Python client) sends `graph_cuts`: the
//! module whose forward ran under `torch.no_grad()`, or that got a tensor without grad
//! history right after another group ran, with the user's call site. They are kept
//! per module, and a `backward_not_reached` alert names the cut seen since its streak
//! began on the subject (or feeding from it): the file and line to look at.
//!
//! A record whose gradients were read at one of several optimizer steps (its
//! `optimizer_steps` ≥ 2, v1.9) cannot show that a module is not updated: a zero or
//! missing gradient there is "not measured", unless its backward hooks never fired
//! in the whole interval; [`super::optimizer_steps`] says what such a loop does.
//!
//! The threshold counts step numbers: a streak from step 0 reaches 50 steps on step
//! 49 whether the client reported every step or every tenth. Steps where an entity
//! is not reported neither extend nor break its streak: "not measured" is not
//! "zero".
//!
//! A module whose weights change while it has no gradient (its fingerprints,
//! `param_sum`, differ: [`super::moved_by_hand`]) is not stuck: a target network
//! copied in by hand or an EMA teacher, held by the optimizer or not, is moved by the
//! training code on purpose, while a module cut off from the graph never moves.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use gradflow_protocol::{Dtype, GraphCut, GraphCutKind, GraphCutVia, LossScaler};

use super::context::RunContext;
use super::episode::{Alerts, Streak};
use super::moved_by_hand::MovedByHand;
use super::view::{GroupMap, StepView};
use super::wording::{is_within, name_list, sci, step_range};
use crate::model::alert::{AlertKind, Opened, Severity};

const KIND: AlertKind = AlertKind::GradStuckZero;

/// More modules of one group than this, stuck together, are one alert.
pub const MAX_MODULE_ALERTS: usize = 3;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StuckZeroGrad {
    groups: BTreeMap<String, ZeroRun>,
    modules: BTreeMap<String, ZeroRun>,
    /// Open alerts that stand for several modules: subject → the modules still stuck.
    batches: BTreeMap<String, Vec<String>>,
    /// The latest graph cut the client reported for each module.
    cuts: BTreeMap<String, SeenCut>,
    /// Modules whose weights move without a gradient (target networks, EMA
    /// teachers): not stuck, whatever their gradient.
    moved_by_hand: MovedByHand,
    /// The run has reported a finite loss other than 0: a loss of exactly 0 from then
    /// on was reached by training (a margin satisfied), not built that way.
    loss_was_nonzero: bool,
}

/// Cuts kept at most (the oldest go first): a client sends one per module per episode.
const MAX_CUTS: usize = 256;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SeenCut {
    step: u64,
    cut: GraphCut,
}

impl SeenCut {
    /// Whether this cut explains `subject` (a group, a module, or a common prefix)
    /// not being reached: its own forward ran without gradients, or it fed the cut:
    /// the module that got its output without history, or the `no_grad` block whose
    /// output the next module got without history (`upstream` of either kind).
    fn explains(&self, subject: &str, group: Option<&str>) -> bool {
        let within = |name: &str| is_within(name, subject) || is_within(subject, name);
        let upstream = self
            .cut
            .upstream
            .as_deref()
            .is_some_and(|u| within(u) || group == Some(u));
        match self.cut.kind {
            GraphCutKind::NoGrad => self.on(subject) || upstream,
            GraphCutKind::DetachedInput => upstream,
        }
    }

    /// Whether the cut was seen on `subject` itself (its module or group).
    fn on(&self, subject: &str) -> bool {
        let within = |name: &str| is_within(name, subject) || is_within(subject, name);
        within(&self.cut.module) || self.cut.group.as_deref().is_some_and(within)
    }
}

/// A run of consecutive zero-gradient steps of one group or module: its
/// [`Streak`], and what the steps of the run showed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "StoredRun", into = "StoredRun")]
struct ZeroRun {
    streak: Streak,
    /// Steps of the run on which every backward hook reported 0 hits.
    hooks_silent: u32,
    /// Steps of the run on which no gradient tensor existed (`null`).
    missing: u32,
    /// Steps of the run on which every backward hook fired (`hook_hits` > 0): a
    /// gradient was accumulated, whatever was left of it at the optimizer step.
    hooks_fired: u32,
    /// The subject of the alert this module's episode belongs to, when it is one
    /// of several modules under a common alert.
    batch: Option<String>,
    /// Steps of the run on which the loop clipped the gradients to a norm of 0
    /// (the client's `grads_clipped_to_zero` metric).
    clipped: u32,
    /// The loss was diverging (`loss_divergence` open) within the run's first
    /// [`DIVERGENCE_STEPS`] reports: the blow-up is what zeroed the gradient.
    diverging: bool,
}

/// Reports at the start of a zero-gradient run within which an open
/// `loss_divergence` makes it the run's cause: that alert opens up to two reports
/// after its condition first holds, and the gradient dies with the blow-up.
const DIVERGENCE_STEPS: u32 = 3;

/// The step metric the Python client sends: how many gradient clips of the watched
/// parameters this step had a limit of 0 (`clip_grad_norm_(max_norm=0)`,
/// `clip_grad_value_(clip_value=0)`), which zero every gradient they touch.
pub const CLIPPED_TO_ZERO_METRIC: &str = "grads_clipped_to_zero";

/// How a [`ZeroRun`] is stored: the layout it had before it counted with
/// [`Streak`], so that stored detector states carry on where they were.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredRun {
    len: u32,
    first_step: u64,
    hooks_silent: u32,
    missing: u32,
    #[serde(default)]
    hooks_fired: u32,
    /// Read and ignored: whether an alert is open is the episodes' to say.
    #[serde(default, skip_serializing)]
    #[allow(dead_code)]
    open: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    batch: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    clipped: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    diverging: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl From<StoredRun> for ZeroRun {
    fn from(stored: StoredRun) -> Self {
        ZeroRun {
            streak: Streak::from_count(stored.len, stored.first_step),
            hooks_silent: stored.hooks_silent,
            missing: stored.missing,
            hooks_fired: stored.hooks_fired,
            batch: stored.batch,
            clipped: stored.clipped,
            diverging: stored.diverging,
        }
    }
}

impl From<ZeroRun> for StoredRun {
    fn from(run: ZeroRun) -> Self {
        StoredRun {
            len: run.streak.count,
            first_step: run.first_step(),
            hooks_silent: run.hooks_silent,
            missing: run.missing,
            hooks_fired: run.hooks_fired,
            open: false,
            batch: run.batch,
            clipped: run.clipped,
            diverging: run.diverging,
        }
    }
}

/// One step's reading of a group or module.
#[derive(Debug, Clone, Copy)]
struct Reading {
    zero: bool,
    hooks_silent: bool,
    hooks_fired: bool,
    missing: bool,
    modules: usize,
    norm: f64,
    /// The step's gradients were clipped to a norm of 0.
    clipped: bool,
    /// The loss was diverging on this step.
    diverging: bool,
}

impl Reading {
    fn merge(&mut self, other: Reading) {
        self.zero &= other.zero;
        self.hooks_silent &= other.hooks_silent;
        self.hooks_fired &= other.hooks_fired;
        self.missing &= other.missing;
        self.clipped &= other.clipped;
        self.diverging &= other.diverging;
        self.modules += other.modules;
        self.norm = (self.norm * self.norm + other.norm * other.norm).sqrt();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    BackwardNotReached,
    ZeroGradient,
    GradMissing,
    /// Backward accumulated a gradient (its hooks fired), yet none was left when the
    /// step was read: something set `.grad` to None in between, a `zero_grad()`
    /// between `backward()` and `step()`.
    ClearedBeforeStep,
    /// Reached, gradient 0, on steps whose gradients the loop clipped to a norm of 0.
    ClippedToZero,
    /// Reached, gradient 0 from when the loss diverged: the blow-up (saturated or
    /// dead units) killed it.
    AfterDivergence,
    /// Reached, gradient 0, in a run whose forward runs under fp16 autocast
    /// (`precision.compute_dtype` f16) with no loss scaler: backward flushes every
    /// gradient below fp16's smallest subnormal to zero.
    Fp16WithoutScaler,
}

impl Cause {
    fn of(run: &ZeroRun, context: &RunContext) -> Cause {
        let len = run.streak.count;
        if run.hooks_silent == len {
            Cause::BackwardNotReached
        } else if run.missing == len && run.hooks_fired == len {
            Cause::ClearedBeforeStep
        } else if run.missing == len {
            Cause::GradMissing
        } else if run.clipped == len {
            Cause::ClippedToZero
        } else if run.diverging {
            Cause::AfterDivergence
        } else if fp16_without_scaler(context) {
            Cause::Fp16WithoutScaler
        } else {
            Cause::ZeroGradient
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Cause::BackwardNotReached => "backward_not_reached",
            Cause::ZeroGradient => "zero_gradient",
            Cause::GradMissing => "grad_missing",
            Cause::ClearedBeforeStep => "cleared_before_step",
            Cause::ClippedToZero => "clipped_to_zero",
            Cause::AfterDivergence => "after_divergence",
            Cause::Fp16WithoutScaler => "fp16_without_scaler",
        }
    }
}

impl ZeroRun {
    /// Folds in one step's reading of `subject`; whether its alert opens now (see
    /// [`Alerts::observe`]). A reading with a gradient ends the run.
    fn observe(
        &mut self,
        alerts: &mut Alerts<'_>,
        subject: &str,
        reading: Reading,
        long_enough: impl FnOnce(&Streak) -> bool,
    ) -> bool {
        let opens = alerts.observe(KIND, subject, &mut self.streak, reading.zero, long_enough);
        if reading.zero {
            self.hooks_silent += u32::from(reading.hooks_silent);
            self.hooks_fired += u32::from(reading.hooks_fired);
            self.missing += u32::from(reading.missing);
            self.clipped += u32::from(reading.clipped);
            self.diverging |= reading.diverging && self.streak.count <= DIVERGENCE_STEPS;
        } else {
            *self = ZeroRun::default();
        }
        opens
    }

    /// The first step of the run (0 when none has begun).
    fn first_step(&self) -> u64 {
        self.streak.since.unwrap_or_default()
    }
}

impl StuckZeroGrad {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let (context, record) = (view.context, view.record);
        let step = record.step;
        self.keep_cuts(step, &record.graph_cuts);
        let threshold = u64::from(context.thresholds.stuck_zero_steps);
        let clipped = view
            .metric(CLIPPED_TO_ZERO_METRIC)
            .is_some_and(|n| n >= 1.0);
        let diverging = alerts.is_open(AlertKind::LossDivergence, "loss");
        let several_updates = record.optimizer_steps.is_some_and(|n| n >= 2);
        let satisfied = self.loss_satisfied(view);
        let mut module_readings: Vec<(&str, &str, Reading)> = Vec::new();
        let mut group_readings: GroupMap<Option<Reading>> = GroupMap::default();
        for (module, info) in view.trainable_modules() {
            let group = info.group.as_str();
            let norm = module.grad_norm.map(|n| n.get());
            let param_sum = module.param_sum.map(|s| s.get());
            // Weights that change while no gradient reaches them are moved by the
            // training code on purpose (a target network copied in, an EMA teacher):
            // not a module the graph was cut off from, whose weights never move.
            let by_hand = self
                .moved_by_hand
                .observe(&module.module, step, norm.is_none(), param_sum);
            let reading = Reading {
                zero: !by_hand && norm.is_none_or(|n| n == 0.0),
                hooks_silent: module.hook_hits == Some(0),
                hooks_fired: module.hook_hits.is_some_and(|hits| hits > 0),
                missing: norm.is_none(),
                modules: 1,
                norm: norm.filter(|n| n.is_finite()).unwrap_or(0.0),
                clipped,
                diverging,
            };
            // Read at one of several optimizer steps (an extra `optimizer.step()`
            // outside the accumulation branch), a zero or missing gradient shows only
            // that one of them found none, not that the weights did not move: not
            // measured. Hooks that never fired over the whole interval still show that
            // backward never reached the module.
            if several_updates && reading.zero && !reading.hooks_silent {
                continue;
            }
            // The loss was exactly 0 and no module got a gradient: the loss had none
            // to give (a margin every sample satisfies), and a step without one says
            // nothing of whether backward can reach a module. Not measured.
            if satisfied {
                continue;
            }
            module_readings.push((&module.module, group, reading));
            match group_readings.entry(group) {
                Some(g) => g.merge(reading),
                slot => *slot = Some(reading),
            }
        }

        for (group, reading) in group_readings.iter() {
            let reading = reading.expect("set when the group was entered");
            let Some(run) = run_for(&mut self.groups, group, reading) else {
                continue;
            };
            if run.observe(alerts, group, reading, |s| s.spans(threshold, step)) {
                let others = healthy_others(&group_readings, group);
                let cut = cut_for(&self.cuts, group, None, run);
                alerts.open(open(
                    context,
                    group,
                    None,
                    reading.modules,
                    run,
                    step,
                    &others,
                    cut,
                ));
            }
        }
        // Modules reaching the threshold this step (their runs open here), by group
        // and cause. A module of a group stuck as a whole waits: the group's alert
        // says it.
        let mut reached: BTreeMap<(&str, &'static str), Vec<&str>> = BTreeMap::new();
        for (module, group, reading) in module_readings {
            let group_stuck = alerts.is_open(KIND, group);
            let Some(run) = run_for(&mut self.modules, module, reading) else {
                continue;
            };
            // A module of a common alert has reached the threshold already.
            let batch = run.batch.clone();
            let alone = batch.is_none();
            let long_enough = |s: &Streak| alone && s.spans(threshold, step) && !group_stuck;
            if run.observe(alerts, module, reading, long_enough) {
                reached
                    .entry((group, Cause::of(run, context).as_str()))
                    .or_default()
                    .push(module);
            }
            if let (Some(subject), false) = (batch, reading.zero) {
                leave_batch(&mut self.batches, &subject, module, step, alerts);
            }
        }
        for ((group, _), modules) in reached {
            if modules.len() <= MAX_MODULE_ALERTS {
                for module in modules {
                    let run = self.modules.get(module).expect("run just opened");
                    let cut = cut_for(&self.cuts, module, Some(group), run);
                    alerts.open(open(context, module, Some(group), 1, run, step, &[], cut));
                }
                continue;
            }
            let subject = batch_subject(group, &modules);
            let example = self.modules.get(modules[0]).expect("run").clone();
            for module in &modules {
                let run = self.modules.get_mut(*module).expect("run just opened");
                run.batch = Some(subject.clone());
            }
            let cut = cut_for(&self.cuts, &subject, Some(group), &example);
            alerts.open(open_batch(
                context, &subject, group, &modules, &example, step, cut,
            ));
            self.batches
                .insert(subject, modules.iter().map(|m| (*m).to_owned()).collect());
        }
        // Keep only what carries information: streaks in progress.
        self.groups.retain(|_, r| r.streak.count > 0);
        self.modules.retain(|_, r| r.streak.count > 0);
    }

    /// Whether this step's loss was satisfied: exactly 0, after the run had reported
    /// another loss, with no trainable module given a gradient. A margin or hinge loss
    /// (a triplet loss once the embedding separates the batch) is exactly 0, with a
    /// gradient of exactly 0 everywhere, on every batch it has nothing to teach; the
    /// steps between still train. A loss that was 0 from the first report (a mask
    /// that leaves nothing in it) is not satisfied but empty, and stays counted, as is
    /// a module at 0 while another module has a gradient.
    fn loss_satisfied(&mut self, view: &StepView<'_>) -> bool {
        let loss = view.record.loss.map(|l| l.get());
        let satisfied = loss == Some(0.0)
            && self.loss_was_nonzero
            && view
                .trainable_modules()
                .all(|(m, _)| m.grad_norm.is_none_or(|n| n.get() == 0.0));
        self.loss_was_nonzero |= loss.is_some_and(|l| l.is_finite() && l != 0.0);
        satisfied
    }

    fn keep_cuts(&mut self, step: u64, cuts: &[GraphCut]) {
        for cut in cuts {
            self.cuts.insert(
                cut.module.clone(),
                SeenCut {
                    step,
                    cut: cut.clone(),
                },
            );
        }
        while self.cuts.len() > MAX_CUTS {
            let oldest = self
                .cuts
                .iter()
                .min_by_key(|(_, seen)| seen.step)
                .map(|(module, _)| module.clone())
                .expect("more than MAX_CUTS entries");
            self.cuts.remove(&oldest);
        }
    }
}

/// The cut that explains a `backward_not_reached` streak on `subject`: one seen since
/// the streak began (an older one belongs to an earlier episode, such as an
/// evaluation under `torch.no_grad()`), a cut on the subject itself before one
/// feeding from it, then the earliest.
fn cut_for<'a>(
    cuts: &'a BTreeMap<String, SeenCut>,
    subject: &str,
    group: Option<&str>,
    run: &ZeroRun,
) -> Option<&'a SeenCut> {
    if run.hooks_silent != run.streak.count {
        return None; // not `backward_not_reached` (the first cause Cause::of tries)
    }
    cuts.values()
        .filter(|seen| seen.step >= run.first_step() && seen.explains(subject, group))
        .min_by_key(|seen| (seen.cut.kind != GraphCutKind::NoGrad, seen.step))
}

/// The fix when a reentrant activation checkpoint cut the graph.
const CHECKPOINT_FIX: &str = "Make the checkpoint's inputs require grad, so that backward \
    enters the checkpointed blocks: model.enable_input_require_grads() (transformers and \
    PEFT models) before training, or checkpoint without reentrancy: \
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": \
    False}), or torch.utils.checkpoint.checkpoint(..., use_reentrant=False).";

/// The sentence that names the cut behind `subject`'s alert, and its evidence.
fn describe_cut(seen: &SeenCut, subject: &str) -> (String, serde_json::Value) {
    let cut = &seen.cut;
    let site = cut.stack.first();
    let called = |who: &str| match site {
        Some(site) => format!(" ({who} called from {site})"),
        None => String::new(),
    };
    let callers = if cut.stack.len() > 1 {
        let chain: Vec<String> = cut.stack[1..].iter().map(|f| f.to_string()).collect();
        format!("; called in turn from {}", chain.join(", from "))
    } else {
        String::new()
    };
    let sentence = match cut.kind {
        GraphCutKind::NoGrad if cut.via == Some(GraphCutVia::ReentrantCheckpoint) => format!(
            " The client saw where: {}'s forward ran inside a reentrant activation checkpoint \
             (torch.utils.checkpoint with use_reentrant=True) at step {}{}{callers}, and none of \
             the checkpoint's inputs requires grad: the checkpoint runs the block under \
             no_grad, and backward never enters it, so trainable parameters inside it (adapters \
             on a frozen base) get no gradient. No torch.no_grad() of the training code did this.",
            cut.module,
            seen.step,
            called("the checkpoint"),
        ),
        GraphCutKind::NoGrad => format!(
            " The client saw where: {}'s forward ran with gradients disabled (torch.no_grad(), \
             inference_mode or set_grad_enabled(False)) at step {}{}{callers}.{}",
            cut.module,
            seen.step,
            called(&cut.module),
            fed_from(seen, subject),
        ),
        GraphCutKind::DetachedInput => format!(
            " The client saw where: {} received a tensor without grad history at step {} although \
             {} had just run with gradients: a .detach(), a tensor rebuilt from data \
             (.tolist(), .numpy(), torch.tensor(...)) or a cached value between {} and {}{}{callers}.",
            cut.module,
            seen.step,
            cut.upstream.as_deref().unwrap_or("another group"),
            cut.upstream.as_deref().unwrap_or("the upstream group"),
            cut.module,
            called(&cut.module),
        ),
    };
    let mut evidence = serde_json::to_value(cut).expect("a graph cut serialises");
    evidence["step"] = json!(seen.step);
    (sentence, evidence)
}

/// For an alert on the group that ran just before a `no_grad` block (its
/// `upstream`), how the block cuts it off too; empty for the block's own alert.
fn fed_from(seen: &SeenCut, subject: &str) -> String {
    match &seen.cut.upstream {
        Some(upstream) if !seen.on(subject) => format!(
            " {upstream} ran with gradients just before it, and the module after the block got \
             its output without grad history: backward stops at the block, so none reaches \
             {subject} through it."
        ),
        _ => String::new(),
    }
}

/// A module of a common alert has a gradient again; the alert resolves when none
/// of its modules is stuck any more.
fn leave_batch(
    batches: &mut BTreeMap<String, Vec<String>>,
    subject: &str,
    module: &str,
    step: u64,
    alerts: &mut Alerts<'_>,
) {
    if let Some(members) = batches.get_mut(subject) {
        members.retain(|m| m != module);
        if members.is_empty() {
            batches.remove(subject);
            alerts.clear(KIND, subject, step);
        }
    }
}

/// The subject of a common alert: the modules' longest common dotted prefix when
/// it says more than the group (`model.layers`), else `{group}.*`.
fn batch_subject(group: &str, modules: &[&str]) -> String {
    let mut prefix: Vec<&str> = modules[0].split('.').collect();
    for module in &modules[1..] {
        let parts: Vec<&str> = module.split('.').collect();
        let common = prefix
            .iter()
            .zip(&parts)
            .take_while(|(a, b)| a == b)
            .count();
        prefix.truncate(common);
    }
    let prefix = prefix.join(".");
    if prefix.is_empty() || prefix == group || !prefix.starts_with(group) {
        format!("{group}.*")
    } else {
        prefix
    }
}

/// One alert for many modules stuck together.
fn open_batch(
    context: &RunContext,
    subject: &str,
    group: &str,
    modules: &[&str],
    example: &ZeroRun,
    step: u64,
    cut: Option<&SeenCut>,
) -> Opened {
    let mut alert = open(
        context,
        subject,
        None,
        modules.len(),
        example,
        step,
        &[],
        cut,
    );
    let total = context
        .trainable_modules_per_group
        .get(group)
        .copied()
        .unwrap_or(modules.len());
    let first = alert.detail.find(" had gradient norm").unwrap_or(0);
    alert.detail = format!(
        "{} of the {total} trainable modules of {group} ({}){}",
        modules.len(),
        name_list(modules, 5),
        &alert.detail[first..],
    ) + " One cause is behind them all: they went to zero on the same step; the rest of the \
       group still trains.";
    alert.evidence["modules"] = json!(modules.len());
    alert.evidence["module_names"] = json!(modules.iter().take(50).collect::<Vec<_>>());
    alert.evidence["group"] = json!(group);
    alert
}

/// The run to update for a reading: the existing one, or a new one for a zero
/// reading. A healthy entity without a run has nothing to update, and on the hot
/// path (every module of every step) that saves allocating its name.
fn run_for<'a>(
    runs: &'a mut BTreeMap<String, ZeroRun>,
    name: &str,
    reading: Reading,
) -> Option<&'a mut ZeroRun> {
    if !runs.contains_key(name) {
        if !reading.zero {
            return None;
        }
        runs.insert(name.to_owned(), ZeroRun::default());
    }
    runs.get_mut(name)
}

/// Groups with a non-zero gradient this step, for the contrast in the detail.
fn healthy_others(readings: &GroupMap<Option<Reading>>, stuck: &str) -> Vec<(String, f64)> {
    readings
        .iter()
        .filter_map(|(g, r)| r.map(|r| (g, r)))
        .filter(|(g, r)| *g != stuck && !r.zero)
        .map(|(g, r)| (g.to_owned(), r.norm))
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn open(
    context: &RunContext,
    subject: &str,
    module_of_group: Option<&str>,
    modules: usize,
    run: &ZeroRun,
    step: u64,
    others: &[(String, f64)],
    cut: Option<&SeenCut>,
) -> Opened {
    let cause = Cause::of(run, context);
    let (reports, first_step, span) = (run.streak.count, run.first_step(), run.streak.span(step));
    let what = match module_of_group {
        Some(group) => format!("Module {subject} (group {group})"),
        None => {
            let total = context
                .trainable_modules_per_group
                .get(subject)
                .copied()
                .unwrap_or(modules);
            format!("Group {subject} ({modules} of its {total} trainable modules reported)")
        }
    };
    let (title, why) = explain(cause, subject);
    let title = title + &format!(": gradient norm 0 for {span} steps");
    let mut detail = format!(
        "{what} had gradient norm 0.00e+00 or no gradient on each of its {} reports over the \
         last {span} steps ({}). {why}",
        reports,
        step_range(first_step, step),
    );
    if !others.is_empty() {
        let contrast: Vec<String> = others
            .iter()
            .map(|(g, n)| format!("{g} {}", sci(*n)))
            .collect();
        detail.push_str(&format!(
            " Meanwhile other groups train (gradient norm at step {step}: {}).",
            contrast.join(", ")
        ));
    }
    let through_checkpoint =
        cut.is_some_and(|seen| seen.cut.via == Some(GraphCutVia::ReentrantCheckpoint));
    let cut = cut.map(|seen| describe_cut(seen, subject));
    if let Some((sentence, _)) = &cut {
        detail.push_str(sentence);
    }
    let fix = fix_for(cause, subject, through_checkpoint);
    let mut opened = Opened {
        kind: KIND,
        subject: subject.to_owned(),
        severity: Severity::Critical,
        first_step: Some(first_step),
        step: Some(step),
        title,
        detail,
        fix,
        evidence: json!({
            "cause": cause.as_str(),
            "steps": span,
            "reports": reports,
            "first_step": first_step,
            "modules": modules,
            "hooks_silent_steps": run.hooks_silent,
            "missing_steps": run.missing,
        }),
    };
    if let Some((_, evidence)) = cut {
        opened.evidence["graph_cut"] = evidence;
    }
    opened
}

/// An alert's title (before its length) and why, for `cause`.
fn explain(cause: Cause, subject: &str) -> (String, &'static str) {
    let title = match cause {
        Cause::BackwardNotReached => format!("Backward never reaches {subject}"),
        Cause::ZeroGradient => format!("Gradient of {subject} is exactly zero"),
        Cause::GradMissing => format!("{subject} gets no gradient"),
        Cause::ClearedBeforeStep => {
            format!("{subject}'s gradients are cleared before the optimizer step")
        }
        Cause::ClippedToZero => format!("{subject}'s gradients are clipped to zero"),
        Cause::AfterDivergence => {
            format!("The loss's divergence killed {subject}'s gradient")
        }
        Cause::Fp16WithoutScaler => {
            format!("fp16 without a loss scaler flushes {subject}'s gradient to zero")
        }
    };
    let why = match cause {
        Cause::BackwardNotReached => {
            "Their backward hooks never fired (hook_hits 0): backward never reached them, \
             so the graph is cut between them and the loss."
        }
        Cause::ZeroGradient => {
            "Their backward hooks fired, so backward reached them, but the gradient that \
             arrived was exactly zero."
        }
        Cause::GradMissing => {
            "No gradient tensor was produced for their parameters (grad is None after backward)."
        }
        Cause::ClearedBeforeStep => {
            "Their backward hooks fired on every one of these steps, so backward did \
             accumulate a gradient, yet at the optimizer step no gradient tensor was left \
             (grad is None): it was cleared in between, and the optimizer skips parameters \
             without a gradient, so nothing is updated."
        }
        Cause::ClippedToZero => {
            "Their backward hooks fired, so backward reached them, and on every one of these \
             steps the loop clipped the gradients with a limit of 0 before the optimizer \
             step: the clip, not the model, set them to zero."
        }
        Cause::AfterDivergence => {
            "Their backward hooks fired, so backward reached them, but the gradient has been \
             exactly zero since the loss diverged: it went to zero within the first steps of \
             the divergence, and has stayed there."
        }
        Cause::Fp16WithoutScaler => {
            "Their backward hooks fired, so backward reached them, but the gradient that \
             arrived was exactly zero, and the forward runs under fp16 autocast with no loss \
             scaler: in backward, every gradient below fp16's smallest value (6e-8) \
             underflows to zero, silently. Small losses and deep models underflow first."
        }
    };
    (title, why)
}

/// The forward runs under fp16 autocast (the client's `precision.compute_dtype`) and
/// no loss scaler is watched.
fn fp16_without_scaler(context: &RunContext) -> bool {
    context
        .registration
        .precision
        .as_ref()
        .is_some_and(|p| {
            p.compute_dtype == Some(Dtype::F16)
                && p.loss_scaler == Some(LossScaler::None)
        })
}

/// What to do about `cause`.
fn fix_for(cause: Cause, subject: &str, through_checkpoint: bool) -> String {
    match cause {
        Cause::BackwardNotReached if through_checkpoint => CHECKPOINT_FIX.to_owned(),
        Cause::BackwardNotReached => format!(
            "Find where the path from {subject}'s output to the loss is cut: a torch.no_grad() or \
         torch.inference_mode() block, a .detach(), a .item()/.tolist()/.numpy() round trip, or \
         a cached tensor computed in an earlier step (e.g. a prompt embedding). Just before \
         the consumer, check that the tensor has requires_grad=True and a grad_fn."
        ),
        Cause::ZeroGradient => format!(
            "Backward reaches {subject} but carries zeros: look for a multiplicative mask or gate \
         that is all zero (a loss or attention mask, a zero-initialised gate), dead ReLUs, or \
         a loss term that does not depend on {subject}'s output."
        ),
        Cause::GradMissing => format!(
            "{subject}'s parameters are not in the graph that backward walks: check that forward \
         uses the same parameter objects the optimizer holds (not a copy made before \
         wrapping or loading), and that requires_grad was not switched off."
        ),
        Cause::ClearedBeforeStep => "Call optimizer.zero_grad() (or model.zero_grad()) at the \
         start of the iteration or right after optimizer.step(), never between \
         loss.backward() and optimizer.step(); look for a zero_grad inside a helper called \
         after backward (a logging or clipping function)."
            .to_owned(),
        Cause::ClippedToZero => "Gradient clipping with a limit of 0 zeroes every gradient \
         it touches: clip_grad_norm_(max_norm=0) scales them by 0 (and \
         clip_grad_value_(clip_value=0) clamps them to 0). Give the clip the limit you \
         meant (max_norm around 1.0), and check where it is read from: a config value of \
         0 meant as \"no clipping\" is taken literally by torch."
            .to_owned(),
        Cause::Fp16WithoutScaler => "Scale the loss so that small gradients survive fp16: \
         scaler = torch.amp.GradScaler(); scaler.scale(loss).backward(); \
         scaler.step(optimizer); scaler.update() (and pass scaler= to gradflow.watch). Or \
         autocast to bf16 instead (torch.autocast(device_type, dtype=torch.bfloat16)), \
         which has fp32's exponent range and needs no scaler. If the gradient stays 0 \
         with a scaler, look for a mask or gate that is all zero."
            .to_owned(),
        Cause::AfterDivergence => format!(
            "The cause is the loss's divergence (the loss_divergence alert): the steps that \
         threw the weights far away saturated or killed the units feeding {subject}, and \
         its gradient has been exactly 0 since. Lower the learning rate (by 10× to start \
         with) or add a warm-up and clip gradients, then restart from a checkpoint taken \
         before the divergence: the dead units do not come back on their own."
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{Run, transitions};
    use crate::detect::thresholds::Thresholds;
    use crate::detect::view::StepView;
    use crate::model::alert::Transition;
    use gradflow_protocol::RunRegistration;
    use gradflow_protocol::StepRecord;
    use serde_json::Value;

    /// A run with groups qwen (3 trainable modules) and agent (2), threshold 5.
    fn context() -> RunContext {
        let registration: RunRegistration = serde_json::from_value(json!({"params": [
            {"name": "qwen.a.weight"}, {"name": "qwen.b.weight"}, {"name": "qwen.c.weight"},
            {"name": "agent.x.weight"}, {"name": "agent.y.weight"},
            {"name": "qwen.frozen.weight", "requires_grad": false}
        ]}))
        .unwrap();
        let thresholds = Thresholds {
            stuck_zero_steps: 5,
            ..Thresholds::default()
        };
        RunContext::new(&registration, thresholds)
    }

    /// A step where each module has the given (grad_norm, hook_hits).
    fn record(step: u64, modules: &[(&str, Value, u32)]) -> StepRecord {
        let modules: Vec<Value> = modules
            .iter()
            .map(|(m, g, h)| json!({"module": m, "grad_norm": g, "hook_hits": h}))
            .collect();
        serde_json::from_value(json!({"step": step, "modules": modules})).unwrap()
    }

    fn detached(step: u64) -> StepRecord {
        record(
            step,
            &[
                ("qwen.a", Value::Null, 0),
                ("qwen.b", Value::Null, 0),
                ("qwen.c", Value::Null, 0),
                ("agent.x", json!(0.5), 1),
                ("agent.y", json!(0.25), 1),
            ],
        )
    }

    fn healthy(step: u64) -> StepRecord {
        record(
            step,
            &[
                ("qwen.a", json!(0.1), 1),
                ("qwen.b", json!(0.2), 1),
                ("qwen.c", json!(0.3), 1),
                ("agent.x", json!(0.5), 1),
                ("agent.y", json!(0.25), 1),
            ],
        )
    }

    fn run(records: &[StepRecord]) -> Vec<(u64, Transition)> {
        let context = context();
        let mut detector = StuckZeroGrad::default();
        transitions(records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        })
    }

    fn opened(t: &Transition) -> &Opened {
        match t {
            Transition::Open(o) => o,
            other => panic!("expected an open, got {other:?}"),
        }
    }

    /// `record` with the client's graph cuts.
    fn with_cuts(mut record: StepRecord, cuts: Value) -> StepRecord {
        record.graph_cuts = serde_json::from_value(cuts).unwrap();
        record
    }

    fn no_grad_on_qwen() -> Value {
        json!([{"module": "qwen", "kind": "no_grad", "group": "qwen", "stack": [
            {"file": "train.py", "line": 87, "function": "encode"},
            {"file": "train.py", "line": 120, "function": "forward"}
        ]}])
    }

    /// `detached(step)` with a fingerprint of each qwen module's weights.
    fn detached_with_sums(step: u64, sum: f64) -> StepRecord {
        let mut record = detached(step);
        for module in record.modules.iter_mut().filter(|m| m.grad_norm.is_none()) {
            module.param_sum = serde_json::from_value(json!(sum)).unwrap();
        }
        record
    }

    #[test]
    fn a_module_moved_without_a_gradient_is_a_target_network_not_a_cut() {
        // qwen never gets a gradient, and its weights change between fingerprints
        // (copied in from a trained module every few steps): no alert.
        let copied: Vec<StepRecord> = (0..12)
            .map(|s| detached_with_sums(s, 1.0 + (s / 3) as f64))
            .collect();
        assert!(run(&copied).is_empty(), "{:?}", run(&copied));
        // The same, its weights where they started on every fingerprint: a cut.
        let cut: Vec<StepRecord> = (0..12).map(|s| detached_with_sums(s, 1.0)).collect();
        let t = run(&cut);
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(opened(&t[0].1).evidence["cause"], "backward_not_reached");
        // Moved only after its alert opened: the alert resolves.
        let mut late: Vec<StepRecord> = (0..8).map(|s| detached_with_sums(s, 1.0)).collect();
        late.extend((8..20).map(|s| detached_with_sums(s, 2.0)));
        let t = run(&late);
        assert!(matches!(t[0], (4, Transition::Open(_))), "{t:?}");
        assert!(
            matches!(t.last(), Some((_, Transition::Resolve { .. }))),
            "{t:?}"
        );
    }

    /// Every module reached with a gradient of exactly 0, the step's loss `loss`.
    fn all_zero(step: u64, loss: f64) -> StepRecord {
        let zero = |m: &'static str| (m, json!(0.0), 1);
        let mut record = record(
            step,
            &["qwen.a", "qwen.b", "qwen.c", "agent.x", "agent.y"].map(zero),
        );
        record.loss = serde_json::from_value(json!(loss)).unwrap();
        record
    }

    #[test]
    fn a_loss_satisfied_to_zero_has_no_gradient_to_give_and_is_not_a_stuck_module() {
        // A margin loss: positive at first, then exactly 0 (every gradient with it)
        // on the batches it has nothing to teach, for longer than the threshold.
        let mut first = healthy(0);
        first.loss = serde_json::from_value(json!(0.4)).unwrap();
        let mut satisfied = vec![first];
        satisfied.extend((1..15).map(|s| all_zero(s, 0.0)));
        assert!(run(&satisfied).is_empty(), "{:?}", run(&satisfied));
        // A loss of 0 from the first report on (a mask that leaves nothing) is empty,
        // not satisfied: still stuck.
        let empty: Vec<StepRecord> = (0..15).map(|s| all_zero(s, 0.0)).collect();
        let t = run(&empty);
        assert!(!t.is_empty(), "{t:?}");
        assert_eq!(opened(&t[0].1).evidence["cause"], "zero_gradient");
        // Gradients of exactly 0 under a loss that is not 0: still stuck.
        let mut flat = vec![satisfied[0].clone()];
        flat.extend((1..15).map(|s| all_zero(s, 0.7)));
        assert!(!run(&flat).is_empty());
        // A module at 0 while the others carry a gradient, under a loss of 0 after a
        // positive one: still stuck.
        let mut alone = vec![satisfied[0].clone()];
        alone.extend((1..15).map(|s| {
            let mut r = record(
                s,
                &[
                    ("qwen.a", json!(0.0), 1),
                    ("qwen.b", json!(0.2), 1),
                    ("qwen.c", json!(0.3), 1),
                    ("agent.x", json!(0.5), 1),
                    ("agent.y", json!(0.25), 1),
                ],
            );
            r.loss = serde_json::from_value(json!(0.0)).unwrap();
            r
        }));
        let t = run(&alone);
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(opened(&t[0].1).subject, "qwen.a");
    }

    #[test]
    fn the_alert_names_the_no_grad_call_the_client_saw() {
        let mut records: Vec<StepRecord> = (0..6).map(detached).collect();
        records[0] = with_cuts(detached(0), no_grad_on_qwen());
        let transitions = run(&records);
        let o = opened(&transitions[0].1);
        assert_eq!(o.subject, "qwen");
        assert!(
            o.detail.contains(
                "qwen's forward ran with gradients disabled (torch.no_grad(), inference_mode or \
                 set_grad_enabled(False)) at step 0 (qwen called from train.py:87 in encode); \
                 called in turn from train.py:120 in forward."
            ),
            "{}",
            o.detail
        );
        let cut = &o.evidence["graph_cut"];
        assert_eq!(cut["kind"], "no_grad");
        assert_eq!(cut["stack"][0]["line"], 87);
        assert_eq!(cut["step"], 0);
    }

    #[test]
    fn a_cut_made_by_a_reentrant_checkpoint_names_it_and_its_fix() {
        let mut records: Vec<StepRecord> = (0..6).map(detached).collect();
        records[0] = with_cuts(
            detached(0),
            json!([{"module": "qwen", "kind": "no_grad", "group": "qwen",
                    "via": "reentrant_checkpoint",
                    "stack": [{"file": "train.py", "line": 87, "function": "forward"}]}]),
        );
        let transitions = run(&records);
        let o = opened(&transitions[0].1);
        assert!(
            o.detail.contains(
                "qwen's forward ran inside a reentrant activation checkpoint (torch.utils.checkpoint \
                 with use_reentrant=True) at step 0 (the checkpoint called from train.py:87 in \
                 forward)"
            ),
            "{}",
            o.detail
        );
        assert!(o.fix.contains("enable_input_require_grads()"), "{}", o.fix);
        assert!(o.fix.contains("use_reentrant=False"), "{}", o.fix);
        assert_eq!(o.evidence["graph_cut"]["via"], "reentrant_checkpoint");
        // Without `via`, the fix stays the general one.
        let mut records: Vec<StepRecord> = (0..6).map(detached).collect();
        records[0] = with_cuts(detached(0), no_grad_on_qwen());
        let o = opened(&run(&records)[0].1).clone();
        assert!(!o.fix.contains("enable_input_require_grads"), "{}", o.fix);
    }

    #[test]
    fn the_alert_names_the_module_that_got_a_detached_input() {
        let mut records: Vec<StepRecord> = (0..6).map(detached).collect();
        records[0] = with_cuts(
            detached(0),
            json!([{"module": "agent.x", "kind": "detached_input", "group": "agent",
                    "upstream": "qwen",
                    "stack": [{"file": "train.py", "line": 112, "function": "forward"}]}]),
        );
        let o = opened(&run(&records)[0].1).clone();
        assert!(
            o.detail.contains(
                "agent.x received a tensor without grad history at step 0 although qwen had just \
                 run with gradients"
            ),
            "{}",
            o.detail
        );
        assert!(
            o.detail
                .contains("(agent.x called from train.py:112 in forward).")
        );
        assert_eq!(o.evidence["graph_cut"]["upstream"], "qwen");
    }

    /// qwen ran with gradients, then a no_grad block (`mid`), then agent.x got its
    /// input without history: qwen's alert names the block's line, not agent.x.
    #[test]
    fn a_no_grad_block_after_a_group_is_named_for_it_before_the_consumer() {
        let mut records: Vec<StepRecord> = (0..6).map(detached).collect();
        records[0] = with_cuts(
            detached(0),
            json!([
                {"module": "mid", "kind": "no_grad", "group": "mid", "upstream": "qwen",
                 "stack": [{"file": "model.py", "line": 17, "function": "forward"}]},
                {"module": "agent.x", "kind": "detached_input", "group": "agent",
                 "upstream": "qwen",
                 "stack": [{"file": "model.py", "line": 18, "function": "forward"}]}
            ]),
        );
        let o = opened(&run(&records)[0].1).clone();
        assert_eq!(o.subject, "qwen");
        assert_eq!(o.evidence["graph_cut"]["module"], "mid");
        assert!(
            o.detail.contains(
                "mid's forward ran with gradients disabled (torch.no_grad(), inference_mode or \
                 set_grad_enabled(False)) at step 0 (mid called from model.py:17 in forward). \
                 qwen ran with gradients just before it, and the module after the block got its \
                 output without grad history: backward stops at the block, so none reaches qwen \
                 through it."
            ),
            "{}",
            o.detail
        );
        // A block's own alert says nothing of the group before it.
        let mut records: Vec<StepRecord> = (0..6).map(detached).collect();
        records[0] = with_cuts(
            detached(0),
            json!([{"module": "qwen", "kind": "no_grad", "group": "qwen", "upstream": "embed",
                    "stack": [{"file": "model.py", "line": 17}]}]),
        );
        let o = opened(&run(&records)[0].1).clone();
        assert!(!o.detail.contains("just before it"), "{}", o.detail);
    }

    #[test]
    fn a_cut_from_before_the_streak_or_on_another_group_is_not_named() {
        // An evaluation under no_grad at step 1, training with gradients after it, the
        // real cut from step 3; and a no_grad cut on agent, which trains.
        let mut records = vec![
            healthy(0),
            with_cuts(healthy(1), no_grad_on_qwen()),
            healthy(2),
        ];
        records.extend((3..10).map(detached));
        records[3] = with_cuts(
            detached(3),
            json!([{"module": "agent.x", "kind": "no_grad", "group": "agent",
                    "stack": [{"file": "eval.py", "line": 5}]}]),
        );
        let transitions = run(&records);
        let o = opened(&transitions[0].1);
        assert_eq!(o.subject, "qwen");
        assert!(o.evidence.get("graph_cut").is_none(), "{:?}", o.evidence);
        assert!(!o.detail.contains("The client saw where"), "{}", o.detail);
    }

    #[test]
    fn a_cut_graph_opens_one_group_alert_exactly_at_the_threshold() {
        let transitions = run(&(0..8).map(detached).collect::<Vec<_>>());
        assert_eq!(transitions.len(), 1, "{transitions:?}");
        let (step, t) = &transitions[0];
        assert_eq!(*step, 4, "the 5th zero step opens it, not the 4th");
        let o = opened(t);
        assert_eq!(o.subject, "qwen");
        assert_eq!(o.evidence["cause"], "backward_not_reached");
        assert_eq!(o.evidence["modules"], 3);
        assert_eq!(o.step, Some(4));
        assert_eq!(o.first_step, Some(0));
        assert!(o.detail.contains("steps 0–4"), "{}", o.detail);
        assert!(o.detail.contains("agent 5.59e-1"), "{}", o.detail);
        assert!(o.fix.contains("no_grad"));
    }

    #[test]
    fn it_resolves_on_the_first_step_with_a_gradient() {
        let mut records: Vec<_> = (0..6).map(detached).collect();
        records.push(healthy(6));
        records.push(healthy(7));
        let transitions = run(&records);
        assert_eq!(transitions.len(), 2);
        assert_eq!(
            transitions[1],
            (
                6,
                Transition::Resolve {
                    kind: AlertKind::GradStuckZero,
                    subject: "qwen".into(),
                    step: 6,
                    last_step: Some(5),
                }
            )
        );
    }

    #[test]
    fn causes_come_from_the_evidence() {
        let zero = |s| {
            record(
                s,
                &[
                    ("qwen.a", json!(0.0), 1),
                    ("qwen.b", json!(0.0), 1),
                    ("qwen.c", json!(0.0), 1),
                ],
            )
        };
        let cleared = |s| {
            record(
                s,
                &[
                    ("qwen.a", Value::Null, 1),
                    ("qwen.b", Value::Null, 1),
                    ("qwen.c", Value::Null, 1),
                ],
            )
        };
        // No hook counts (a client without backward hooks): nothing says a gradient
        // ever existed.
        let missing = |s| {
            let modules =
                ["qwen.a", "qwen.b", "qwen.c"].map(|m| json!({"module": m, "grad_norm": null}));
            serde_json::from_value(json!({"step": s, "modules": modules})).unwrap()
        };
        for (make, cause) in [
            (&zero as &dyn Fn(u64) -> StepRecord, "zero_gradient"),
            (&cleared, "cleared_before_step"),
            (&missing, "grad_missing"),
            (&detached, "backward_not_reached"),
        ] {
            let transitions = run(&(0..5).map(make).collect::<Vec<_>>());
            assert_eq!(opened(&transitions[0].1).evidence["cause"], cause);
        }
    }

    /// Gradients of 0 that backward did reach, on steps whose `metrics` the client
    /// filled.
    fn zero_with(step: u64, metrics: Value) -> StepRecord {
        let mut r = record(
            step,
            &[
                ("qwen.a", json!(0.0), 1),
                ("qwen.b", json!(0.0), 1),
                ("qwen.c", json!(0.0), 1),
                ("agent.x", json!(0.5), 1),
                ("agent.y", json!(0.25), 1),
            ],
        );
        r.metrics = serde_json::from_value(metrics).unwrap();
        r
    }

    /// A clip to `max_norm=0` (as in strands-labs/robots#2028's table: "0 of 34,701
    /// parameters moved") zeroes gradients that backward reached: the alert names the
    /// clip, not masks or dead units. A clip on some steps only is not the cause.
    #[test]
    fn a_clip_to_zero_is_named_as_the_cause() {
        let clipped = json!({CLIPPED_TO_ZERO_METRIC: 1.0});
        let t = run(&(0..5)
            .map(|s| zero_with(s, clipped.clone()))
            .collect::<Vec<_>>());
        let o = opened(&t[0].1);
        assert_eq!(o.evidence["cause"], "clipped_to_zero", "{o:?}");
        assert!(o.fix.contains("max_norm=0"), "{}", o.fix);
        let some = (0..5)
            .map(|s| zero_with(s, if s == 2 { clipped.clone() } else { json!({}) }))
            .collect::<Vec<_>>();
        assert_eq!(opened(&run(&some)[0].1).evidence["cause"], "zero_gradient");
    }

    /// fp16 autocast with no loss scaler (engichang1467/Open-Rig3R#35): a gradient of
    /// exactly 0 that backward reached names the underflow and its fix. The same zeros
    /// under bf16, or with a scaler watched, or where the client did not say, keep
    /// the general cause.
    #[test]
    fn fp16_autocast_without_a_scaler_is_named_as_the_cause() {
        let cause_under = |precision: Value| {
            let mut registration: RunRegistration =
                serde_json::to_value(&context().registration)
                    .and_then(serde_json::from_value)
                    .unwrap();
            registration.precision = serde_json::from_value(precision).unwrap();
            let context = RunContext::new(&registration, context().thresholds);
            let mut detector = StuckZeroGrad::default();
            let t = transitions(
                (0..5).map(|s| zero_with(s, json!({}))).collect::<Vec<_>>(),
                |r, out| detector.on_step(&StepView::new(&context, r), out),
            );
            opened(&t[0].1).clone()
        };
        let o = cause_under(json!({"compute_dtype": "f16", "loss_scaler": "none"}));
        assert_eq!(o.evidence["cause"], "fp16_without_scaler", "{o:?}");
        assert!(o.fix.contains("GradScaler"), "{}", o.fix);
        assert!(o.fix.contains("bfloat16"), "{}", o.fix);
        for precision in [
            json!({"compute_dtype": "bf16", "loss_scaler": "none"}),
            json!({"compute_dtype": "f16", "loss_scaler": "dynamic"}),
            json!({"compute_dtype": "f16"}),
        ] {
            let o = cause_under(precision.clone());
            assert_eq!(o.evidence["cause"], "zero_gradient", "{precision}");
        }
    }

    /// A gradient that went to 0 as the loss diverged was killed by the blow-up
    /// (gradflow-trainer --scenario lr-too-high): the alert leads with the
    /// divergence. One already at 0 long before the loss diverged is not blamed on
    /// it.
    #[test]
    fn a_gradient_killed_by_a_divergence_names_the_divergence() {
        let context = context();
        let divergence = |step| Opened {
            kind: AlertKind::LossDivergence,
            subject: "loss".into(),
            severity: Severity::Warning,
            first_step: Some(step),
            step: Some(step),
            title: String::new(),
            detail: String::new(),
            fix: String::new(),
            evidence: json!({"cause": "divergence"}),
        };
        let judge = |diverges_at: u64| {
            let mut detector = StuckZeroGrad::default();
            let mut all = Vec::new();
            let mut episodes = crate::detect::testing::Run::default();
            for step in 0..8 {
                all.extend(episodes.step(step, |alerts| {
                    if step == diverges_at {
                        alerts.open(divergence(step));
                    }
                    let record = zero_with(step, json!({}));
                    detector.on_step(&StepView::new(&context, &record), alerts);
                }));
            }
            all.into_iter()
                .filter_map(|t| match t {
                    Transition::Open(o) if o.kind == KIND => Some(o),
                    _ => None,
                })
                .next()
                .expect("a zero-gradient alert")
        };
        let o = judge(1);
        assert_eq!(o.evidence["cause"], "after_divergence", "{o:?}");
        assert!(o.title.starts_with("The loss's divergence"), "{}", o.title);
        assert!(o.fix.contains("Lower the learning rate"), "{}", o.fix);
        assert_eq!(judge(6).evidence["cause"], "zero_gradient");
    }

    /// An extra optimizer.step() after the accumulation branch's zero_grad
    /// (thunlp/OpenPrompt#106's loop): the read, at the first of four steps, finds no
    /// gradient, while the other steps update the weights. Not "nothing is updated";
    /// a graph cut over the whole interval still is one.
    #[test]
    fn a_read_at_one_of_several_optimizer_steps_is_not_measured() {
        let several = |mut r: StepRecord| {
            r.optimizer_steps = Some(4);
            r
        };
        let cleared = |s| {
            several(record(
                s,
                &[
                    ("qwen.a", Value::Null, 1),
                    ("qwen.b", Value::Null, 1),
                    ("qwen.c", Value::Null, 1),
                ],
            ))
        };
        assert!(run(&(0..20).map(cleared).collect::<Vec<_>>()).is_empty());
        let cut = run(&(0..5).map(|s| several(detached(s))).collect::<Vec<_>>());
        assert_eq!(opened(&cut[0].1).evidence["cause"], "backward_not_reached");
    }

    #[test]
    fn healthy_and_intermittent_streams_stay_silent() {
        // Zero at step 0 only, as in the original log.
        let mut records = vec![detached(0)];
        records.extend((1..100).map(healthy));
        assert!(run(&records).is_empty());
        // Qwen back-propagated only every 10th step (prompt caching): nine zeros in ten.
        let cached: Vec<_> = (0..200)
            .map(|s| if s % 10 == 0 { healthy(s) } else { detached(s) })
            .collect();
        let context = RunContext::new(&context().registration, Thresholds::default());
        let mut detector = StuckZeroGrad::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        for r in &cached {
            out.extend(run.step(r.step, |a| detector.on_step(&StepView::new(&context, r), a)));
        }
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn unreported_steps_neither_extend_nor_break_a_streak() {
        let mut records = Vec::new();
        for s in 0..4 {
            records.push(detached(s));
        }
        records.push(record(4, &[("agent.x", json!(0.5), 1)])); // qwen not measured
        records.push(detached(5));
        let transitions = run(&records);
        assert_eq!(transitions.len(), 1);
        assert_eq!(transitions[0].0, 5);
    }

    #[test]
    fn a_few_dead_modules_in_a_healthy_group_are_named_individually() {
        let records: Vec<_> = (0..6)
            .map(|s| {
                record(
                    s,
                    &[
                        ("qwen.a", json!(0.0), 1),
                        ("qwen.b", json!(0.2), 1),
                        ("qwen.c", json!(0.3), 1),
                    ],
                )
            })
            .collect();
        let transitions = run(&records);
        assert_eq!(transitions.len(), 1);
        let o = opened(&transitions[0].1);
        assert_eq!(o.subject, "qwen.a");
        assert!(
            o.detail.starts_with("Module qwen.a (group qwen)"),
            "{}",
            o.detail
        );
    }

    #[test]
    fn many_modules_stuck_together_are_one_alert_with_real_hugging_face_names() {
        // A Hugging Face model is one group (`model`); a cut below the shared
        // embedding leaves every decoder layer at zero while lm_head still trains.
        let mut params = vec![json!({"name": "lm_head.weight", "group": "model"})];
        for layer in 0..8 {
            for part in ["self_attn.q_proj", "mlp.up_proj"] {
                params.push(json!({
                    "name": format!("model.layers.{layer}.{part}.weight"),
                    "group": "model"
                }));
            }
        }
        let registration: RunRegistration =
            serde_json::from_value(json!({ "params": params })).unwrap();
        let context = RunContext::new(
            &registration,
            Thresholds {
                stuck_zero_steps: 5,
                ..Thresholds::default()
            },
        );
        let step = |s: u64, stuck: bool| -> StepRecord {
            let mut modules = vec![json!({"module": "lm_head", "grad_norm": 0.7, "hook_hits": 1})];
            for layer in 0..8 {
                for part in ["self_attn.q_proj", "mlp.up_proj"] {
                    let (norm, hits) = if stuck { (0.0, 0) } else { (0.1, 1) };
                    modules.push(json!({"module": format!("model.layers.{layer}.{part}"),
                                        "grad_norm": norm, "hook_hits": hits}));
                }
            }
            serde_json::from_value(json!({"step": s, "modules": modules})).unwrap()
        };
        let mut records: Vec<StepRecord> = (0..8).map(|s| step(s, true)).collect();
        records.push(step(8, false));
        let mut detector = StuckZeroGrad::default();
        let t = transitions(&records, |r, out| {
            detector.on_step(&StepView::new(&context, r), out)
        });
        assert_eq!(t.len(), 2, "one alert and its resolution, not 16: {t:?}");
        let o = opened(&t[0].1);
        assert_eq!(o.subject, "model.layers");
        assert_eq!(o.evidence["cause"], "backward_not_reached");
        assert_eq!(o.evidence["modules"], 16);
        assert!(
            o.detail
                .starts_with("16 of the 17 trainable modules of model"),
            "{}",
            o.detail
        );
        assert!(
            matches!(&t[1], (8, Transition::Resolve { subject, .. }) if subject == "model.layers")
        );
    }

    #[test]
    fn thresholds_count_step_numbers_when_a_client_reports_every_tenth_step() {
        let every: Vec<_> = (0..60).map(detached).collect();
        let sparse: Vec<_> = (0..60).step_by(10).map(detached).collect();
        let context = context();
        let opened_at = |records: &[StepRecord]| {
            let mut detector = StuckZeroGrad::default();
            let t = transitions(records, |r, out| {
                detector.on_step(&StepView::new(&context, r), out)
            });
            t.first().map(|(s, _)| *s)
        };
        // Threshold 5: every step opens on step 4; every tenth, on the first report
        // at or after it.
        assert_eq!(opened_at(&every), Some(4));
        assert_eq!(opened_at(&sparse), Some(10));
    }

    #[test]
    fn modules_without_trainable_parameters_are_ignored() {
        let records: Vec<_> = (0..10)
            .map(|s| {
                record(
                    s,
                    &[("qwen.frozen", Value::Null, 0), ("qwen.a", json!(1.0), 1)],
                )
            })
            .collect();
        assert!(run(&records).is_empty());
    }

    #[test]
    fn a_state_stored_in_the_earlier_layout_carries_on_mid_streak() {
        // Four zero steps of qwen, stored as the run was laid out before it counted
        // with episode::Streak (the same keys it is still stored under).
        let stored = json!({"groups": {"qwen": {"len": 4, "first_step": 0, "hooks_silent": 4,
            "missing": 4, "hooks_fired": 0, "open": false}}});
        let mut detector: StuckZeroGrad = serde_json::from_value(stored).unwrap();
        let context = context();
        let out = Run::default().step(4, |a| {
            detector.on_step(&StepView::new(&context, &detached(4)), a)
        });
        let o = opened(&out[0]);
        assert_eq!((o.subject.as_str(), o.first_step), ("qwen", Some(0)));
        assert_eq!(o.evidence["cause"], "backward_not_reached");
        assert_eq!(o.evidence["reports"], 5);
        let saved = serde_json::to_value(&detector).unwrap();
        assert_eq!(
            saved["groups"]["qwen"],
            json!({"len": 5, "first_step": 0, "hooks_silent": 5, "missing": 5,
                   "hooks_fired": 0})
        );
    }

    #[test]
    fn state_survives_serialization_mid_streak() {
        let context = context();
        let mut detector = StuckZeroGrad::default();
        let mut run = Run::default();
        let mut out = Vec::new();
        for s in 0..3 {
            out.extend(run.step(s, |a| {
                detector.on_step(&StepView::new(&context, &detached(s)), a)
            }));
        }
        let saved = serde_json::to_string(&detector).unwrap();
        let mut restored: StuckZeroGrad = serde_json::from_str(&saved).unwrap();
        out.extend(run.step(3, |a| {
            restored.on_step(&StepView::new(&context, &detached(3)), a)
        }));
        assert!(out.is_empty());
        out.extend(run.step(4, |a| {
            restored.on_step(&StepView::new(&context, &detached(4)), a)
        }));
        assert_eq!(out.len(), 1);
    }
}
