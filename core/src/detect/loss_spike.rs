//! `loss_spike` (v1.8): the loss, or the gradient norm with it, jumps far above its
//! recent level for a step or a few — and, where the numbers say, why: a bad batch
//! (`data_batch`), the embedding's gradient rising first (`embedding_first`), an Adam
//! update spike before it (`optimizer_state`), else `unknown`.
//!
//! # The rule
//!
//! The level of the loss and of the global gradient norm (the L2 norm of every
//! reported module's) is the mean and standard deviation of their last 128 readings
//! ([`Rolling`]), judged once [`MIN_HISTORY`] readings are in. A step spikes when its
//! loss is above mean + [`SIGMAS`]·σ and at least [`MIN_LOSS_EXCESS`] of the mean
//! above it, or when its gradient norm is above mean + [`SIGMAS`]·σ and
//! [`MIN_GRAD_RATIO`]× its mean while the loss is above mean + 3σ — and, either way,
//! the series that spiked is beyond its own tail: its logarithm at least
//! [`LOG_DEVIATIONS`] robust standard deviations (the median absolute deviation of
//! the window's logarithms, scaled) above the median of the window's logarithms. A
//! loss that has been zero or below (since v1.11: at any step of the run, as
//! `loss_divergence` judges it) is not an error training drives down to 0 but an
//! objective of another kind (a policy-gradient or actor-critic loss, an
//! adversarial or contrastive term, a density's negative log-likelihood): it has no
//! log scale, and spikes through the gradient norm's rule only. A reading goes into
//! the window clipped to the σ bar, so one spike does not hide the next. A spike is
//! rare (since v1.13): a window whose readings leapt from its bulk (within [`BULK`]
//! deviations) at least half as far, or rose from below half its size to above it,
//! [`RECURRING`] separate times, already has such excursions as a matter of course.
//!
//! The alert opens on the report after the spike, dated at the spike's step, when
//! the cause can be read:
//!
//! - `data_batch`: one micro-batch's loss at least [`MICRO_FACTOR`]× the median of the
//!   step's micro-batch losses, or on a multi-rank run one rank's own loss that far
//!   above the ranks' median (the step's loss is their mean), or (v1.9) the batch's
//!   repeated-token share (`batch.repeated_token_share`) at least [`REPEAT_FACTOR`]×
//!   the median of its last 128 readings and [`REPEAT_EXCESS`] above it (a batch
//!   that is mostly one token), or the loss back under its bar on the very next step
//!   (the model was fine on the next batch: the spike was that batch's). The step's
//!   batch ids are named. The first three open on the spike's own report.
//! - `optimizer_state`: a module's Adam update RMS (`adam.update_rms`) spiked by
//!   `adam_update_spike`'s rule (2× its own level and beyond its jitter) within
//!   [`PRECURSOR_STEPS`] steps before the spike (the Marin 32B pattern: update spikes
//!   precede loss spikes).
//! - `embedding_first`: on the report before the spike the embedding's gradient norm
//!   was already 3× its level while the rest was not (GLM-130B).
//! - `unknown`: none of these.
//!
//! # Why these numbers
//!
//! 6σ over 128 readings is OLMo-core's and Levanter's skip-step rule. On a 0.13 M
//! parameter GPT (docs/instabilities.md) one batch of a single repeated token at step
//! 150 took the loss from 1.2 to 8.05 and the gradient norm from 0.55 to 20.9 for one
//! step; gradflow's `grad_explosion` (1,000×) and `loss_divergence` (3× the start)
//! both stay silent there. The 64 readings of history keep the warm-up (a loss
//! falling fast, a gradient norm that moves 20× in 15 steps) out of the window's
//! first judgement; the relative floors keep a loss that has converged to a flat
//! line, whose σ is tiny, from spiking on noise.
//!
//! 6σ alone assumes light tails. A healthy loss with heavy ones passes it now and
//! then: REINFORCE whose loss grows with the return (29 of 30 seeds, 200 episodes),
//! batches of one under Student-t noise (21 of the 28 seeds that did not diverge,
//! 300 steps), InfoNCE over batches of four (3 of 3, 400 steps). What tells those
//! excursions from a bad batch was measured at every step 6σ passed, replaying the
//! detector's clipped windows; the true spikes were one batch of a single repeated
//! token in the GPT above at step 100, 150 or 250 (β₂ 0.95 and 0.999), and a batch of
//! boxes in pixels instead of fractions in a heavy-tailed box regression (3 seeds):
//!
//! | statistic of the spiking reading | healthy tails, largest | true spikes, smallest |
//! | --- | --- | --- |
//! | loss / window's max | 9.9 (batch of one) | 2.1 (step 150: the warm-up's losses are in the window) |
//! | gradient norm / window's max | 6.5 (REINFORCE) | 2.1 (box regression; the GPT 21) |
//! | loss, (ln − mean) / σ of the logs | 3.7 | 4.7 |
//! | loss, (ln − median) / upper-half MAD of the logs | 3.8 | 3.7 |
//! | loss, (ln − median) / MAD of the logs | 3.9 (REINFORCE; batch of one 3.0, InfoNCE 2.8) | 12.8 (box regression 15.6; step 250: 53) |
//! | gradient norm, same | 4.7 (REINFORCE) | 50 (box regression 5.3, caught by its loss) |
//!
//! Only the MAD of the logarithms separates them with room on both sides: the
//! median and MAD of the logs measure the bulk of the readings, which a heavy tail
//! does not move, on the multiplicative scale a loss's noise has; a loss averaged
//! over many tokens has a narrow bulk (σ of its logs 0.04) and a bad batch lies
//! dozens of those above it, while a batch of one spreads over orders of magnitude
//! (σ of its logs 1.7–2.0) and its largest excursions stay within 3–4. 7 is the
//! geometric middle of 3.9 and 12.8, 1.8× from each. The price: in a loss that wide,
//! only a batch about 10⁵ times its median loss, or 10³ times its median gradient
//! norm, is a spike (two of the 30 batch-of-one seeds diverged, the loss to 1e22,
//! and were called at 7–22 deviations on the way). The bad batch at step 100 with
//! β₂ = 0.999 passes no 6σ bar (the warm-up is in its window), before and after.
//!
//! Both bars assume the excursions are rare. SB3's A2C on CartPole (the fifth
//! validation set's look-alike, its gradient clipped to 0.5 every step) has a bulk
//! near 2 and, every few steps, a batch whose returns jumped: 40–170, often 20–30 of
//! them in 128 steps. Its largest passed both bars on every seed (121–231 against a
//! median of 3–4, 7–9 robust deviations of the logarithms). What tells it from a bad
//! batch is that it recurs: 19–31 readings of the window are above 20, and each of
//! them leapt there from the bulk, most more than half as far as the spike, while a
//! bad batch's window holds no such leap (the warm-up it may begin with falls
//! through the tail into the bulk: none of its readings comes from the bulk). Four
//! such leaps in 128 readings are more than any true spike's window here held and
//! far fewer than A2C's. The same holds on the plain scale: DCRNN under scheduled
//! sampling (the fourth validation set's look-alike; batches drawn mostly from its
//! own forecasts spike its loss 2.2× and its gradient 5–7× their means) has risen
//! to half such a reading time and again, while the tiny GPT's bad batch at step
//! 150 is 2.1× its window's largest reading. Either count of four is the
//! series' own regime.

use gradflow_protocol::Role;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::episode::Alerts;
use super::rolling::{Level, LogSpread, Rolling};
use super::update_levels::UpdateLevels;
use super::view::StepView;
use super::wording::{name_list, sci};
use crate::model::alert::{AlertKind, Opened, Severity};

/// Standard deviations above the mean that make a spike.
pub const SIGMAS: f64 = 6.0;
/// Readings in the window before anything is judged.
pub const MIN_HISTORY: usize = 64;
/// A loss spike is also at least this fraction of its mean above the mean.
pub const MIN_LOSS_EXCESS: f64 = 0.25;
/// A gradient-norm spike is also at least this many times its mean.
pub const MIN_GRAD_RATIO: f64 = 4.0;
/// A spike is also this many robust standard deviations above its window's median
/// on a log scale ([`LogSpread`](super::rolling::LogSpread)): beyond the series' own
/// tail.
pub const LOG_DEVIATIONS: f64 = 7.0;
/// A spike is rare: a window whose readings leapt from its bulk at least half as far
/// (in robust deviations of its logarithms), or rose to half its size, this many
/// separate times makes such excursions as a matter of course, and one more is not
/// a spike.
pub const RECURRING: usize = 4;
/// Robust deviations above the median of the logarithms within which a reading is in
/// the window's bulk.
pub const BULK: f64 = LOG_DEVIATIONS / 4.0;
/// A micro-batch this many times the step's median micro-batch loss is the culprit.
pub const MICRO_FACTOR: f64 = 2.0;
/// A batch's repeated-token share this many times the median of its window is a
/// repeated-token batch...
pub const REPEAT_FACTOR: f64 = 2.0;
/// ...and at least this much above it (a share is a fraction of a sequence): a run
/// whose batches are all repetitive (padding) has no batch far above its usual.
pub const REPEAT_EXCESS: f64 = 0.25;
/// Readings of the share before its median is the run's usual.
pub const REPEAT_HISTORY: usize = 16;
/// An update spike this many steps before a loss spike preceded it.
pub const PRECURSOR_STEPS: u64 = 20;
/// The embedding's gradient norm this many times its level, the rest not, on the
/// report before the spike: it rose first.
pub const EMBEDDING_FIRST_FACTOR: f64 = 3.0;
/// Batch ids named in the alert's text (the evidence holds every one sent).
const IDS_SHOWN: usize = 8;

const SUBJECT: &str = "loss";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LossSpike {
    /// Whether the loss has been 0 or below: an objective training does not drive
    /// down to 0 (a policy-gradient surrogate, an adversarial or contrastive term,
    /// a negative log-likelihood of a density), whose size has no log scale.
    crossed_zero: bool,
    loss: Rolling,
    grad: Rolling,
    embedding: Rolling,
    /// The rest of the gradient (all but the embedding), for `embedding_first`.
    rest: Rolling,
    /// On the last report: the embedding's and the rest's ratio to their means.
    last_ratios: Option<(f64, f64)>,
    /// Each module's Adam update RMS level.
    updates: UpdateLevels,
    /// The last update spike: step, module, ratio to its level.
    last_update_spike: Option<(u64, String, f64)>,
    /// A spike waiting for the next report to be judged.
    pending: Option<Spike>,
    /// The batches' repeated-token shares (v1.9).
    repeats: Rolling,
}

/// A step that spiked, with what its cause is read from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Spike {
    step: u64,
    loss: f64,
    loss_mean: f64,
    loss_std: f64,
    /// Readings the level was taken over.
    readings: usize,
    grad: Option<f64>,
    grad_mean: Option<f64>,
    /// The bar the loss must be back under for the spike to have lasted one step.
    bar: f64,
    ids: Vec<String>,
    micro_losses: Vec<f64>,
    /// A multi-rank step's ranks' own losses (its loss is their mean).
    #[serde(default)]
    rank_losses: Vec<(u32, f64)>,
    embedding_first: Option<(f64, f64)>,
    update_spike: Option<(u64, String, f64)>,
    /// The step's repeated-token share and the median of the run's, when the batch
    /// is far more repetitive than the run's usual.
    #[serde(default)]
    repeated_tokens: Option<(f64, f64)>,
}

impl LossSpike {
    pub fn on_step(&mut self, view: &StepView<'_>, alerts: &mut Alerts<'_>) {
        let record = view.record;
        let loss = record.loss.map(|l| l.get()).filter(|l| l.is_finite());
        if let Some(spike) = self.pending.take() {
            let back = loss.is_some_and(|l| l <= spike.bar);
            let next_step = record.step == spike.step + 1;
            alerts.open(spike.alert(back && next_step));
        }
        // The update spike with the largest ratio of this step, for the next spikes.
        if let Some(spike) = self
            .updates
            .observe(view)
            .into_iter()
            .max_by(|a, b| a.ratio().total_cmp(&b.ratio()))
        {
            let step = record.step;
            self.last_update_spike = Some((step, spike.module.to_owned(), spike.ratio()));
        }
        let Some(loss) = loss else {
            return;
        };
        if view.found_inf() {
            return;
        }
        let grad = global_norm(view);
        let (embedding, rest) = embedding_split(view);
        self.crossed_zero |= loss <= 0.0;
        let spiked = self.judge(loss, grad);
        match spiked {
            Some(spike) if !alerts.holds(AlertKind::LossSpike, SUBJECT) => {
                let spike = self.describe(view, loss, grad, spike);
                if spike.batch_proven() {
                    alerts.open(spike.alert(false));
                } else {
                    self.pending = Some(spike);
                }
            }
            Some(_) => {}
            None => alerts.clear(AlertKind::LossSpike, SUBJECT, record.step),
        }
        self.last_ratios = ratio(&self.embedding, embedding).zip(ratio(&self.rest, rest));
        push_clipped(&mut self.loss, loss);
        if let Some(grad) = grad {
            push_clipped(&mut self.grad, grad);
        }
        if let Some(embedding) = embedding {
            push_clipped(&mut self.embedding, embedding);
        }
        if let Some(rest) = rest {
            push_clipped(&mut self.rest, rest);
        }
        if let Some(share) = repeated_token_share(view) {
            self.repeats.push(share);
        }
    }

    /// The step's repeated-token share and the run's usual (the median of its last
    /// readings), when the share is far above it.
    fn repeated_tokens(&self, view: &StepView<'_>) -> Option<(f64, f64)> {
        let share = repeated_token_share(view)?;
        if self.repeats.len() < REPEAT_HISTORY {
            return None;
        }
        let usual = self.repeats.median()?;
        (share >= REPEAT_FACTOR * usual && share - usual >= REPEAT_EXCESS)
            .then_some((share, usual))
    }

    /// The loss's and the gradient norm's levels, when this step spikes.
    fn judge(&self, loss: f64, grad: Option<f64>) -> Option<(Level, Option<Level>)> {
        let level = self.loss.level().filter(|l| l.count >= MIN_HISTORY)?;
        let loss_spikes = !self.crossed_zero
            && loss > level.bar(SIGMAS)
            && loss - level.mean >= MIN_LOSS_EXCESS * level.mean.abs()
            && beyond_its_tail(&self.loss, loss);
        let grad_level = self.grad.level().filter(|l| l.count >= MIN_HISTORY);
        let grad_spikes = grad.zip(grad_level).is_some_and(|(g, l)| {
            g > l.bar(SIGMAS)
                && g >= MIN_GRAD_RATIO * l.mean
                && loss > level.bar(3.0)
                && beyond_its_tail(&self.grad, g)
        });
        (loss_spikes || grad_spikes).then_some((level, grad_level))
    }

    fn describe(
        &self,
        view: &StepView<'_>,
        loss: f64,
        grad: Option<f64>,
        (level, grad_level): (Level, Option<Level>),
    ) -> Spike {
        let batch = view.record.batch.as_ref();
        let step = view.record.step;
        Spike {
            step,
            loss,
            loss_mean: level.mean,
            loss_std: level.std,
            readings: level.count,
            grad,
            grad_mean: grad_level.map(|l| l.mean),
            bar: level.bar(3.0).max(level.mean * (1.0 + MIN_LOSS_EXCESS)),
            ids: batch.map(|b| b.ids.clone()).unwrap_or_default(),
            micro_losses: batch
                .map(|b| b.micro_losses.iter().map(|l| l.get()).collect())
                .unwrap_or_default(),
            rank_losses: view.ranks.map(|r| r.losses.clone()).unwrap_or_default(),
            embedding_first: self
                .last_ratios
                .filter(|&(e, r)| e >= EMBEDDING_FIRST_FACTOR && r < 1.5),
            update_spike: self
                .last_update_spike
                .clone()
                .filter(|(s, _, _)| *s < step && step - s <= PRECURSOR_STEPS),
            repeated_tokens: self.repeated_tokens(view),
        }
    }
}

impl Spike {
    /// The micro-batch far above the step's others, with its loss and their median.
    fn micro_culprit(&self) -> Option<(usize, f64, f64)> {
        far_above_the_rest(self.micro_losses.iter().copied().enumerate())
    }

    /// The rank far above the step's other ranks, with its loss and their median: its
    /// batch, on a multi-rank run, where the step's loss is the ranks' mean.
    fn rank_culprit(&self) -> Option<(u32, f64, f64)> {
        far_above_the_rest(self.rank_losses.iter().copied())
    }

    /// Whether the step's own numbers prove its batch the cause (no need to wait
    /// for the next report).
    fn batch_proven(&self) -> bool {
        self.micro_culprit().is_some()
            || self.rank_culprit().is_some()
            || self.repeated_tokens.is_some()
    }

    /// The cause, in the order of how directly the numbers prove it.
    fn cause(&self, one_step: bool) -> &'static str {
        if self.batch_proven() {
            "data_batch"
        } else if self.update_spike.is_some() {
            "optimizer_state"
        } else if self.embedding_first.is_some() {
            "embedding_first"
        } else if one_step {
            "data_batch"
        } else {
            "unknown"
        }
    }

    fn alert(&self, one_step: bool) -> Opened {
        let cause = self.cause(one_step);
        let ratio = self.loss / self.loss_mean;
        let z = (self.loss - self.loss_mean) / self.loss_std.max(f64::MIN_POSITIVE);
        let step = self.step;
        let grad = match (self.grad, self.grad_mean) {
            (Some(g), Some(m)) if m > 0.0 => format!(
                " The gradient norm was {} against a mean of {} ({:.1}×).",
                sci(g),
                sci(m),
                g / m
            ),
            _ => String::new(),
        };
        Opened {
            kind: AlertKind::LossSpike,
            subject: SUBJECT.into(),
            severity: Severity::Warning,
            first_step: Some(step),
            step: Some(step),
            title: format!("Loss spike at step {step}: {ratio:.1}× its recent mean ({cause})"),
            detail: format!(
                "At step {step} the loss was {} against a mean of {} over its last {} \
                 readings ({z:.0}σ above; the bar is {SIGMAS}σ).{grad} {}",
                sci(self.loss),
                sci(self.loss_mean),
                self.readings,
                self.why(cause, one_step),
            ),
            fix: fix(cause).into(),
            evidence: json!({
                "cause": cause,
                "loss": self.loss,
                "loss_mean": self.loss_mean,
                "loss_std": self.loss_std,
                "ratio": ratio,
                "grad_norm": self.grad,
                "grad_norm_mean": self.grad_mean,
                "batch_ids": self.ids,
                "micro_losses": self.micro_losses,
                "rank": self.rank_culprit().map(|(rank, _, _)| rank),
                "one_step": one_step,
                "update_spike": self.update_spike.as_ref().map(|(s, m, r)| json!({
                    "step": s, "module": m, "ratio": r})),
                "embedding_ratio": self.embedding_first.map(|(e, _)| e),
                "repeated_token_share": self.repeated_tokens.map(|(share, _)| share),
                "repeated_token_share_usual": self.repeated_tokens.map(|(_, usual)| usual),
            }),
        }
    }

    /// The sentence that says why the cause is this one.
    fn why(&self, cause: &str, one_step: bool) -> String {
        let ids = if self.ids.is_empty() {
            "The client sent no batch ids (gf.step(batch_ids=...) names them).".to_owned()
        } else {
            let shown: Vec<&str> = self.ids.iter().map(String::as_str).collect();
            format!("The step's batch ids: {}.", name_list(&shown, IDS_SHOWN))
        };
        match cause {
            "data_batch" => match (self.micro_culprit(), self.rank_culprit()) {
                (None, None) if self.repeated_tokens.is_some() => {
                    let (share, usual) = self.repeated_tokens.expect("just checked");
                    format!(
                        "One token id made up {:.0} % of a sequence of this batch, where the \
                         run's batches usually reach {:.0} %: a repeated-token batch. {ids}",
                        100.0 * share,
                        100.0 * usual
                    )
                }
                (Some((i, worst, median)), _) => format!(
                    "Micro-batch {i}'s loss was {} while the step's median was {}: that batch \
                     is far off the others. {ids}",
                    sci(worst),
                    sci(median)
                ),
                (None, Some((rank, worst, median))) => format!(
                    "Rank {rank}'s own loss was {} while the ranks' median was {}: that rank's \
                     batch is far off the others' (the step's loss is their mean). {ids}",
                    sci(worst),
                    sci(median)
                ),
                (None, None) if one_step => format!(
                    "On the next step the loss was back under its bar: the model was fine on \
                     the next batch, so this step's batch caused it. {ids}"
                ),
                (None, None) => ids,
            },
            "optimizer_state" => {
                let (s, module, r) = self.update_spike.as_ref().expect("the cause says so");
                format!(
                    "At step {s}, before the spike, Adam's update in {module} was {r:.1}× its \
                     own level: the optimizer's state moved first. {ids}"
                )
            }
            "embedding_first" => format!(
                "On the report before the spike the embedding's gradient norm was already \
                 {:.1}× its level while the rest of the model's was not: it rose first. {ids}",
                self.embedding_first.map_or(0.0, |(e, _)| e)
            ),
            _ => format!(
                "The loss stayed high on the next report and nothing before it moved: the \
                 numbers sent do not say why. {ids}"
            ),
        }
    }
}

/// The labelled value at least [`MICRO_FACTOR`]× the median of the finite values
/// (two or more of them), with it and the median.
fn far_above_the_rest<L: Copy>(values: impl Iterator<Item = (L, f64)>) -> Option<(L, f64, f64)> {
    let finite: Vec<(L, f64)> = values.filter(|(_, v)| v.is_finite()).collect();
    if finite.len() < 2 {
        return None;
    }
    let mut sorted: Vec<f64> = finite.iter().map(|&(_, v)| v).collect();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[(sorted.len() - 1) / 2];
    let &(label, worst) = finite.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    (median > 0.0 && worst >= MICRO_FACTOR * median).then_some((label, worst, median))
}

fn fix(cause: &str) -> &'static str {
    match cause {
        "data_batch" => {
            "Look at those batches (repeated tokens, corrupt or mislabelled samples): filter them \
             or skip them. For a spike that does not recover, rewind to a checkpoint about 100 \
             steps earlier and skip the batches around it (PaLM skipped 200–500). A skip-step \
             rule (loss above mean + 6σ of the last 128 steps: OLMo-core, Levanter) keeps one \
             bad batch from moving the weights."
        }
        "optimizer_state" => {
            "Clip the update, not only the gradient (Levanter's ClipUpdateNorm: mean + 2–3σ of \
             the last 128 update norms), or skip the step; lowering β₂ to 0.95 lets Adam's second \
             moment follow sudden gradients faster."
        }
        "embedding_first" => {
            "Scale the embedding's output (×√d, or an embedding LayerNorm: Spike No More), shrink \
             its gradient (GLM-130B: ×0.1), and keep weight decay off the embedding (OLMo 2)."
        }
        _ => {
            "Send batch ids (gf.step(batch_ids=...)) and the micro-batch losses so the next spike \
             can be traced to its data; meanwhile a skip-step rule (mean + 6σ of the last 128 \
             losses) or update clipping keeps one spike from moving the weights."
        }
    }
}

/// The step's repeated-token share (v1.9), when the client measured it.
fn repeated_token_share(view: &StepView<'_>) -> Option<f64> {
    let share = view.record.batch.as_ref()?.repeated_token_share?.get();
    share.is_finite().then_some(share)
}

/// The L2 norm of every reported module's gradient norm; `None` without one.
fn global_norm(view: &StepView<'_>) -> Option<f64> {
    let mut any = false;
    let sum: f64 = view
        .group_norms
        .iter()
        .map(|(_, n)| {
            any = true;
            n * n
        })
        .sum();
    (any && sum.is_finite()).then(|| sum.sqrt())
}

/// The embedding's gradient norm and the rest's, when the registration names an
/// embedding and the step reported it.
fn embedding_split(view: &StepView<'_>) -> (Option<f64>, Option<f64>) {
    let params = &view.context.registration.params;
    let is_embedding = |module: &str| {
        params
            .iter()
            .any(|p| p.role() == Role::Embedding && p.module_name() == module)
    };
    let (mut embedding, mut rest, mut seen) = (0.0, 0.0, false);
    for module in &view.record.modules {
        let Some(norm) = module.grad_norm.map(|n| n.get()).filter(|n| n.is_finite()) else {
            continue;
        };
        if is_embedding(&module.module) {
            embedding += norm * norm;
            seen = true;
        } else {
            rest += norm * norm;
        }
    }
    if seen {
        (Some(embedding.sqrt()), Some(rest.sqrt()))
    } else {
        (None, None)
    }
}

/// `value` over the window's mean, once the window has its history.
fn ratio(window: &Rolling, value: Option<f64>) -> Option<f64> {
    let level = window.level().filter(|l| l.count >= MIN_HISTORY)?;
    (level.mean > 0.0).then(|| value.map(|v| v / level.mean))?
}

/// Whether `value` lies more than [`LOG_DEVIATIONS`] robust standard deviations
/// above its window's median on a log scale, and the window neither leapt from its
/// bulk at least half as far nor rose to half its size [`RECURRING`] separate times
/// (a series whose excursions come back every few dozen steps has two regimes, not a
/// spike: the median and MAD describe its bulk only). A window that holds a reading
/// at or below zero has no such scale: a loss that crosses zero spikes only through
/// the gradient norm's rule.
fn beyond_its_tail(window: &Rolling, value: f64) -> bool {
    window.log_spread().is_some_and(|spread| {
        let z = spread.z(value);
        z >= LOG_DEVIATIONS
            && excursions(window, &spread, z / 2.0) < RECURRING
            && window.rises_to(value / 2.0) < RECURRING
    })
}

/// Readings of `window` at least `height` robust deviations of `spread` above its
/// median that leapt there straight from its bulk (the reading before within
/// [`BULK`] of them): each one a separate excursion. A warm-up the window begins
/// with falls through the tail into the bulk and never leaps out of it, so it counts
/// none.
fn excursions(window: &Rolling, spread: &LogSpread, height: f64) -> usize {
    window.leaps(|v| spread.z(v) < BULK, |v| spread.z(v) >= height)
}

/// A reading into its window, clipped to the spike bar so one spike does not hide
/// the next.
fn push_clipped(window: &mut Rolling, value: f64) {
    let clipped = match window.level() {
        Some(level) if level.count >= MIN_HISTORY => value.min(level.bar(SIGMAS)),
        _ => value,
    };
    window.push(clipped);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::testing::{record, viewed};
    use crate::model::alert::Transition;
    use serde_json::Value;

    /// A healthy loss falling with noise and a gradient norm around 0.6, from the
    /// probe's numbers; `bad` replaces one step with the bad batch's.
    fn run(steps: u64, edit: impl Fn(u64, &mut Value)) -> Vec<(u64, Transition)> {
        let mut detector = LossSpike::default();
        let records: Vec<_> = (0..steps)
            .map(|step| {
                let noise = ((step * 7919) % 13) as f64 / 13.0 - 0.5;
                let loss = 1.2 + 4.0 * (-(step as f64) / 20.0).exp() + 0.1 * noise;
                let grad = 0.6 + 0.1 * noise;
                let mut value = json!({"step": step, "loss": loss,
                    "modules": [{"module": "tok", "grad_norm": grad * 0.1},
                                {"module": "layers.0", "grad_norm": grad}],
                    "batch": {"ids": [format!("b{step}")]}});
                edit(step, &mut value);
                record(value)
            })
            .collect();
        viewed(records, |view, alerts| detector.on_step(view, alerts))
    }

    fn opened(t: &[(u64, Transition)]) -> Vec<(u64, Opened)> {
        t.iter()
            .filter_map(|(s, t)| match t {
                Transition::Open(o) => Some((*s, o.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_one_step_bad_batch_is_named_at_its_step_with_its_ids() {
        let t = run(300, |step, v| {
            if step == 150 {
                v["loss"] = json!(8.05);
                v["modules"][1]["grad_norm"] = json!(20.9);
            }
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        let (at, alert) = &opened[0];
        assert_eq!(
            (*at, alert.step, alert.first_step),
            (151, Some(150), Some(150))
        );
        assert_eq!(alert.evidence["cause"], "data_batch");
        assert_eq!(alert.evidence["batch_ids"], json!(["b150"]));
        assert!(alert.detail.contains("b150"), "{}", alert.detail);
    }

    /// Shares like the bigram batches' of docs/instabilities.md (0.06–0.31, median
    /// 0.125 as the client reads them).
    fn usual_share(step: u64) -> f64 {
        0.0625 * (1 + step % 5) as f64
    }

    #[test]
    fn a_loss_that_has_crossed_zero_spikes_only_through_its_gradient() {
        // An actor-critic loss: negative once at step 10, a value-loss jump of 7x at
        // step 150 under a gradient at its usual level: silent. The same jump with
        // the gradient 30x its level still opens.
        let crossed = |grad: f64| {
            run(300, move |step, v| {
                if step == 10 {
                    v["loss"] = json!(-0.3);
                }
                if step == 150 {
                    v["loss"] = json!(8.05);
                    v["modules"][1]["grad_norm"] = json!(grad);
                }
            })
        };
        assert!(opened(&crossed(0.6)).is_empty());
        let spikes = opened(&crossed(20.9));
        assert_eq!(spikes.len(), 1, "{spikes:?}");
        assert_eq!(spikes[0].1.first_step, Some(150));
    }

    #[test]
    fn a_repeated_token_batch_is_named_at_once_with_its_share() {
        let t = run(300, |step, v| {
            v["batch"]["repeated_token_share"] = json!(usual_share(step));
            if step == 150 {
                v["loss"] = json!(8.05);
                v["modules"][1]["grad_norm"] = json!(20.9);
                v["batch"]["repeated_token_share"] = json!(1.0);
            }
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        let (at, alert) = &opened[0];
        assert_eq!((*at, alert.first_step), (150, Some(150)));
        assert_eq!(alert.evidence["cause"], "data_batch");
        assert_eq!(alert.evidence["repeated_token_share"], 1.0);
        let usual = alert.evidence["repeated_token_share_usual"].as_f64().unwrap();
        assert!((0.0625..=0.3125).contains(&usual), "{usual}");
        assert!(alert.detail.contains("100 % of a sequence"), "{}", alert.detail);
    }

    #[test]
    fn a_share_near_the_runs_usual_proves_nothing() {
        // Every batch mostly padding (share 0.8–0.9): the spiking one's 1.0 is not far
        // above the run's usual, so the cause waits for the next report as before.
        let t = run(300, |step, v| {
            v["batch"]["repeated_token_share"] = json!(0.8 + 0.1 * (step % 2) as f64);
            if step == 150 {
                v["loss"] = json!(8.05);
                v["batch"]["repeated_token_share"] = json!(1.0);
            }
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        assert_eq!(opened[0].0, 151);
        assert!(opened[0].1.evidence["repeated_token_share"].is_null());
        // A repetitive batch without a spike opens nothing.
        let t = run(300, |step, v| {
            let share = if step == 150 { 1.0 } else { usual_share(step) };
            v["batch"]["repeated_token_share"] = json!(share);
        });
        assert!(t.is_empty(), "{t:?}");
    }

    #[test]
    fn a_micro_batch_far_above_the_others_is_named_at_once() {
        let t = run(200, |step, v| {
            if step == 120 {
                v["loss"] = json!(9.0);
                v["batch"]["micro_losses"] = json!([1.2, 1.3, 9.5, 1.25]);
            }
            if step > 120 {
                v["loss"] = json!(9.0);
            }
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        assert_eq!(opened[0].0, 120);
        assert_eq!(opened[0].1.evidence["cause"], "data_batch");
        assert!(opened[0].1.detail.contains("Micro-batch 2"));
    }

    #[test]
    fn one_rank_far_above_the_others_is_named_at_once() {
        use crate::detect::ranks::view::RankView;
        use gradflow_protocol::StepRecord;
        use crate::detect::testing::{empty_context, transitions};
        let context = empty_context();
        let mut detector = LossSpike::default();
        let steps: Vec<(StepRecord, RankView)> = (0..200u64)
            .map(|step| {
                let noise = ((step * 7919) % 13) as f64 / 13.0 - 0.5;
                let own = |rank: u32| 1.2 + 0.1 * noise + 0.01 * f64::from(rank);
                let mut losses: Vec<(u32, f64)> = (0..4).map(|r| (r, own(r))).collect();
                if step == 120 {
                    losses[2].1 = 30.0; // rank 2's batch
                }
                let mean = losses.iter().map(|(_, l)| l).sum::<f64>() / 4.0;
                let rec = record(json!({"step": step, "loss": mean,
                    "modules": [{"module": "layers.0", "grad_norm": 0.6}]}));
                let view = RankView {
                    step,
                    world_size: 4,
                    reported: 4,
                    losses,
                    ..RankView::default()
                };
                (rec, view)
            })
            .collect();
        let records: Vec<&StepRecord> = steps.iter().map(|(r, _)| r).collect();
        let t = transitions(records, |record, alerts| {
            let ranks = steps.iter().find(|(r, _)| r.step == record.step).map(|(_, v)| v);
            detector.on_step(&StepView::new(&context, record).with_ranks(ranks), alerts)
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        assert_eq!((opened[0].0, opened[0].1.evidence["rank"].clone()), (120, json!(2)));
        assert_eq!(opened[0].1.evidence["cause"], "data_batch");
        assert!(opened[0].1.detail.contains("Rank 2's own loss"), "{}", opened[0].1.detail);
    }

    #[test]
    fn an_update_spike_before_the_loss_spike_blames_the_optimizer_state() {
        let t = run(200, |step, v| {
            if step % 10 == 0 {
                let rms = if step == 140 { 0.9 } else { 0.22 };
                v["modules"][1]["adam"] = json!({"update_rms": rms});
            }
            if step >= 150 {
                v["loss"] = json!(6.0);
            }
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        assert_eq!(opened[0].1.evidence["cause"], "optimizer_state");
        assert_eq!(opened[0].1.evidence["update_spike"]["step"], 140);
    }

    /// A loss spread log-uniformly over two decades around 0.5 (a batch of one's),
    /// with every 37th step 20× that (its tail): far above mean + 6σ, within its
    /// own spread on a log scale.
    fn heavy_tailed(step: u64) -> f64 {
        let spread = ((step * 7919) % 13) as f64 / 12.0 * 2.0 - 1.0;
        let tail = if step % 37 == 36 { 20.0 } else { 1.0 };
        0.5 * 10f64.powf(spread) * tail
    }

    #[test]
    fn a_heavy_tailed_loss_is_silent_and_a_batch_beyond_its_tail_is_named() {
        let t = run(400, |step, v| v["loss"] = json!(heavy_tailed(step)));
        assert!(t.is_empty(), "{t:?}");
        let t = run(400, |step, v| {
            v["loss"] = json!(heavy_tailed(step));
            if step == 300 {
                v["loss"] = json!(5e4);
                v["modules"][1]["grad_norm"] = json!(20.9);
            }
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        assert_eq!(opened[0].1.first_step, Some(300));
        assert_eq!(opened[0].1.evidence["cause"], "data_batch");
    }

    /// An actor-critic's loss, from SB3's A2C on CartPole (fifth validation set): a
    /// bulk near 2 and, every eight steps, the value loss of a batch whose returns
    /// jumped, 40 to 100, now and then 170 (the mean near 10, σ near 25, so 170 is
    /// past mean + 6σ and dozens of the log-MADs of the bulk above its median, as
    /// each excursion is); the loop clips every step's gradient to one bound.
    fn bimodal(step: u64) -> f64 {
        let noise = ((step * 7919) % 13) as f64 / 13.0;
        if step % 97 == 50 {
            170.0
        } else if step % 8 == 3 {
            40.0 + 60.0 * noise
        } else {
            1.8 + 0.6 * noise
        }
    }

    #[test]
    fn recurring_excursions_are_the_series_own_and_a_rare_one_is_a_spike() {
        let clipped = |v: &mut Value, loss: f64| {
            v["loss"] = json!(loss);
            v["modules"][1]["grad_norm"] = json!(0.5);
        };
        // Excursions of 20-90x the bulk come back every eight steps: silent.
        let t = run(400, |step, v| clipped(v, bimodal(step)));
        assert!(t.is_empty(), "{t:?}");
        // The same bulk with one such excursion: a spike, at its step.
        let t = run(300, |step, v| {
            clipped(v, if step == 200 { 150.0 } else { 1.8 + 0.6 * (step % 2) as f64 })
        });
        let opened = opened(&t);
        assert_eq!(opened.len(), 1, "{t:?}");
        assert_eq!(opened[0].1.first_step, Some(200));
    }

    #[test]
    fn healthy_losses_stay_silent() {
        // The falling loss with noise, warm-up included.
        assert!(run(400, |_, _| {}).is_empty());
        // A loss converged to a flat line with tiny noise, then a blip of 10 %.
        let t = run(300, |step, v| {
            let loss = if step == 250 {
                1.1e-3
            } else {
                1e-3 + 1e-7 * (step % 3) as f64
            };
            v["loss"] = json!(loss);
        });
        assert!(t.is_empty(), "{t:?}");
        // A gradient norm that moves 20× in 15 steps while the loss does not spike.
        let t = run(300, |step, v| {
            if (200..215).contains(&step) {
                v["modules"][1]["grad_norm"] = json!(0.6 * (1 + step - 200) as f64 * 1.4);
            }
        });
        assert!(t.is_empty(), "{t:?}");
        // A spike within the warm-up history is not judged.
        let t = run(200, |step, v| {
            if step == 30 {
                v["loss"] = json!(20.0);
            }
        });
        assert!(t.is_empty(), "{t:?}");
    }
}
