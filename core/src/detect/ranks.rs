//! The verdicts only distributed training has, judged on each combined step of a
//! multi-rank run (v1.4): what the ranks' records of one step showed together.
//!
//! - `rank_missing`: a step was completed without a rank's record — the rank
//!   stopped reporting, or fell so far behind that the others could not wait for
//!   it, or closed (v1.5: its client finished) without having sent it. Resolves
//!   when the rank's records reach the combined steps again.
//! - `rank_straggler`: a rank's own work on each step (`step_time`) takes at least
//!   [`STRAGGLER_RATIO`]× the other ranks' median, on [`STRAGGLER_STEPS`] step
//!   numbers running. In lockstep data parallelism every rank's wall-clock step is
//!   the same (the fast ranks wait at the all-reduce), so only each rank's own work
//!   tells which one the others wait for.
//! - `rank_nonfinite`: a NaN or infinite reading (loss, a module's gradient) on some
//!   ranks but not all. After the gradient all-reduce a rank's NaN spreads to every
//!   rank, so the step where it shows on a few ranks only names where it began: that
//!   rank's batch, or rank-local code after the reduce. When a NaN in one rank's
//!   batch reaches every rank's gradients within the step (the all-reduce comes
//!   before the record is read), the ranks' own losses still tell: the loss is
//!   computed before the reduce, so the ranks whose loss alone is not finite are
//!   where it began.
//! - `replica_divergence`: modules or parameters laid out `replicated` whose ranks
//!   disagree, beyond float noise, on [`DIVERGENCE_STEPS`] step numbers running.
//!   After the all-reduce every replica holds the same gradient and takes the same
//!   optimizer step, so a disagreement is a desynchronised replica: a rank that
//!   skipped the reduce (`no_sync` left on), unsynchronised buffers, a module outside
//!   the data-parallel wrapper.
//!   *(v1.5)* Under DDP the gradients are all-reduced whatever the weights are, so
//!   replicas whose weights have come apart (a rank that changes its weights outside
//!   the optimizer, or steps with other settings) still agree on every gradient:
//!   each rank then sends now and then a fingerprint of each module's weights (the
//!   sum of its elements), and replicas that disagree on [`WEIGHTS_READINGS`]
//!   fingerprints running are `replica_divergence` on the subject `weights`.
//! - `shard_reported_as_global`: a parameter's module registered `replicated` whose
//!   ranks each report a part of its elements, the parts adding up to the whole: a
//!   client read each rank's local shard of a sharded tensor (FSDP2, ZeRO) as if it
//!   were the whole. Its combined norm is then wrong (the first rank's shard only),
//!   and a rank whose shard is empty reports a false zero.
//!
//! Like every detector these are pure: the combined step's view in, transitions out.
//! The thresholds count step numbers, as elsewhere.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{AlertKind, Opened, Severity, Transition, name_list, sci, step_range};

/// A rank is a straggler at a step when its work takes at least this many times the
/// other ranks' median...
pub const STRAGGLER_RATIO: f64 = 1.5;
/// ...and at least this many seconds more (microsecond steps are all noise).
pub const STRAGGLER_MIN_EXCESS: f64 = 0.005;
/// Step numbers running that make a straggler alert, and that end one.
pub const STRAGGLER_STEPS: u64 = 10;
/// Replicas disagree when their values differ by more than this, relative to the
/// larger magnitude: identical all-reduced gradients give identical norms, and f32
/// storage keeps them identical.
pub const DIVERGENCE_TOLERANCE: f64 = 1e-4;
/// Step numbers running with a disagreement that open `replica_divergence` (one
/// step is a coincidence worth no alert; a desynchronised replica stays so).
pub const DIVERGENCE_STEPS: u64 = 3;
/// The series name of the weights' fingerprints among the compared values.
pub const WEIGHTS_SERIES: &str = "param_sum";
/// Fingerprint readings running (steps that carried one; a client sends them every
/// few steps) on which replicas disagree that open `replica_divergence` on `weights`.
pub const WEIGHTS_READINGS: usize = 2;
/// The ranks' reported elements must add up to the registered whole within this
/// fraction for `shard_reported_as_global`.
pub const SHARD_SUM_TOLERANCE: f64 = 0.01;

/// What the ranks of a multi-rank run showed at one combined step.
#[derive(Debug, Clone, Default)]
pub struct RankView {
    pub step: u64,
    pub world_size: u32,
    /// Ranks whose record of this step arrived.
    pub reported: u32,
    /// Ranks whose record never came (the step completed without them), each with
    /// the last step it reported.
    pub missing: Vec<(u32, Option<u64>)>,
    /// Each reporting rank's `step_time`, when it sent one.
    pub step_times: Vec<(u32, f64)>,
    /// Ranks with a non-finite reading at this step (the first few), each with (up
    /// to a few of) the subjects that were not finite.
    pub nonfinite: Vec<(u32, Vec<String>)>,
    /// How many ranks had one, listed or not.
    pub nonfinite_count: u32,
    /// Replicated subjects whose ranks disagree.
    pub divergences: Vec<Divergence>,
    /// Replicated modules whose ranks each report part of the elements.
    pub shard_suspects: Vec<ShardSuspect>,
    /// Of the `missing` ranks, those that had closed (v1.5: their client said it
    /// finished), so the step was completed at once instead of waited for.
    pub closed: Vec<u32>,
    /// Reporting ranks whose own loss was not finite (computed before any
    /// all-reduce, so it says which ranks a NaN began on).
    pub loss_nonfinite: Vec<u32>,
    /// Whether replicas' weight fingerprints were compared at this step (v1.5).
    pub fingerprinted: bool,
}

/// A replicated module's or parameter's value on which its ranks disagree.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// The module or parameter.
    pub subject: String,
    /// The series (`grad_norm`, `update_norm`, `param_mean`, …).
    pub series: &'static str,
    /// The smallest and largest value, with a rank that had each.
    pub min: (f64, u32),
    pub max: (f64, u32),
}

impl Divergence {
    /// The spread relative to the larger magnitude.
    pub fn relative(&self) -> f64 {
        let scale = self.min.0.abs().max(self.max.0.abs());
        if scale == 0.0 {
            0.0
        } else {
            (self.max.0 - self.min.0) / scale
        }
    }
}

/// A module registered `replicated` whose ranks report parts of its elements.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardSuspect {
    pub module: String,
    pub group: String,
    /// Elements of the module's parameters as registered (their shapes).
    pub registered: u64,
    /// Elements each rank reported: the largest, and the sum over ranks.
    pub largest: u64,
    pub sum: u64,
    pub ranks: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankDetectors {
    /// Open `rank_missing` episodes: rank → first step it was missing from.
    missing: BTreeMap<u32, u64>,
    stragglers: BTreeMap<u32, Streak>,
    /// Open `rank_nonfinite` episodes: rank → the step it began.
    nonfinite: BTreeMap<u32, u64>,
    divergence: Streak,
    /// Of the weights' fingerprints (v1.5): counted in readings, not steps.
    weights: Streak,
    /// Open `shard_reported_as_global` alerts, by group.
    shards: BTreeSet<String>,
    /// Ranks whose client said it closed (v1.5, `POST .../finish?rank=N`): the
    /// steps they did not send are completed at once, without waiting for them. A
    /// record from a closed rank reopens it. Kept here so that it is stored with the
    /// run's detector state.
    pub closed: BTreeSet<u32>,
}

/// A run of step numbers on which a condition held (or, once open, did not).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
struct Streak {
    since: Option<u64>,
    open: bool,
    /// Once open: the first step of the current run of steps without it.
    clear_since: Option<u64>,
    /// The values seen over the streak, for the alert's numbers (bounded).
    samples: Vec<(f64, f64)>,
}

const MAX_SAMPLES: usize = 64;

fn rank_subject(rank: u32) -> String {
    format!("rank {rank}")
}

impl RankDetectors {
    pub fn on_step(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        self.on_missing(view, out);
        self.on_stragglers(view, out);
        self.on_nonfinite(view, out);
        self.on_divergence(view, out);
        self.on_weights(view, out);
        self.on_shards(view, out);
    }

    fn on_missing(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        let missing: BTreeMap<u32, Option<u64>> = view.missing.iter().copied().collect();
        // Ranks back in the combined step.
        resolve_ranks_gone(
            &mut self.missing,
            |rank| missing.contains_key(rank),
            AlertKind::RankMissing,
            view.step,
            out,
        );
        for (&rank, &last) in &missing {
            if self.missing.contains_key(&rank) {
                continue;
            }
            self.missing.insert(rank, view.step);
            let last_text = match last {
                Some(last) => format!("its last record was of step {last}"),
                None => "it has sent no record at all".to_owned(),
            };
            let closed = view.closed.contains(&rank);
            let why = if closed {
                format!(
                    "rank {rank} closed (its client finished) without having sent it, so                      the step was completed at once"
                )
            } else {
                "the other ranks moved on and the server could not wait longer".to_owned()
            };
            out.push(Transition::Open(Opened {
                kind: AlertKind::RankMissing,
                subject: rank_subject(rank),
                severity: Severity::Critical,
                first_step: Some(view.step),
                step: Some(view.step),
                title: format!(
                    "Rank {rank} of {} stopped reporting: step {} completed without it",
                    view.world_size, view.step
                ),
                detail: format!(
                    "Step {} of this {}-rank run was completed from {} ranks' records without \
                     rank {rank}'s: {why}; {last_text}. {}Until it is back the run's norms \
                     of sharded parameters lack its shards.",
                    view.step,
                    view.world_size,
                    view.reported,
                    if closed {
                        "Its training loop stopped calling gf.step (a branch only that rank \
                         takes, an exception caught around it, a loop that ends early on that \
                         rank) while the job went on. "
                    } else {
                        "Its process may have died (out of memory, a collective timeout), \
                         hung, or lost its way to the server (then its records arrive later \
                         from its spool). "
                    }
                ),
                fix: format!(
                    "Look at rank {rank}'s process and log first (OOM killer, NCCL/gloo \
                     timeout, an exception only it raised). If it is alive and training, check \
                     that it can reach the gradflow server. Under torchrun an elastic restart \
                     (--max-restarts) brings a lost rank back."
                ),
                evidence: json!({
                    "cause": "stopped_reporting",
                    "rank": rank,
                    "world_size": view.world_size,
                    "ranks_reported": view.reported,
                    "last_step": last,
                    "closed": closed,
                }),
            }));
        }
    }

    fn on_stragglers(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        if view.step_times.len() < 2 {
            return;
        }
        for &(rank, time) in &view.step_times {
            let mut others: Vec<f64> = view
                .step_times
                .iter()
                .filter(|(r, t)| *r != rank && t.is_finite())
                .map(|(_, t)| *t)
                .collect();
            if others.is_empty() || !time.is_finite() {
                continue;
            }
            others.sort_by(f64::total_cmp);
            let median = others[others.len() / 2];
            let slow = time >= STRAGGLER_RATIO * median && time - median >= STRAGGLER_MIN_EXCESS;
            let streak = self.stragglers.entry(rank).or_default();
            if let Some(transition) = straggler_step(streak, rank, view, slow, time, median) {
                out.push(transition);
            }
        }
        self.stragglers
            .retain(|_, streak| streak.open || streak.since.is_some());
    }

    fn on_nonfinite(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        let ranks: BTreeMap<u32, &Vec<String>> =
            view.nonfinite.iter().map(|(r, s)| (*r, s)).collect();
        // A rank whose readings are finite again.
        resolve_ranks_gone(
            &mut self.nonfinite,
            |rank| ranks.contains_key(rank),
            AlertKind::RankNonfinite,
            view.step,
            out,
        );
        // Only a strict subset of the reporting ranks says where it began: of those
        // with any non-finite reading, or else of those whose own loss was not finite
        // (a NaN in one rank's batch reaches every rank's gradients in the same step).
        let loss_count = view.loss_nonfinite.len() as u32;
        let by_loss =
            view.nonfinite_count >= view.reported && loss_count > 0 && loss_count < view.reported;
        let subset = view.nonfinite_count > 0 && view.nonfinite_count < view.reported;
        if !subset && !by_loss {
            return;
        }
        let origin: BTreeMap<u32, Vec<String>> = if by_loss {
            view.loss_nonfinite
                .iter()
                .map(|r| {
                    let subjects = ranks
                        .get(r)
                        .map_or_else(|| vec!["loss".to_owned()], |s| (*s).clone());
                    (*r, subjects)
                })
                .collect()
        } else {
            ranks.iter().map(|(r, s)| (*r, (*s).clone())).collect()
        };
        let spread: Vec<u32> = if by_loss {
            ranks
                .keys()
                .filter(|r| !origin.contains_key(r))
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        let ranks = origin;
        for (&rank, subjects) in &ranks {
            if self.nonfinite.contains_key(&rank) {
                continue;
            }
            self.nonfinite.insert(rank, view.step);
            let names: Vec<&str> = subjects.iter().map(String::as_str).collect();
            let others: Vec<u32> = ranks.keys().filter(|r| **r != rank).copied().collect();
            out.push(Transition::Open(Opened {
                kind: AlertKind::RankNonfinite,
                subject: rank_subject(rank),
                severity: Severity::Critical,
                first_step: Some(view.step),
                step: Some(view.step),
                title: format!(
                    "Non-finite {} on rank {rank} only, at step {}",
                    if by_loss { "loss" } else { "values" },
                    view.step
                ),
                detail: if by_loss {
                    format!(
                        "At step {}, every reporting rank's gradients were NaN or infinite, \
                         but only {} of the {} ranks computed a non-finite loss (rank {rank}: \
                         {}){}. The loss is each rank's own, computed before the gradient \
                         all-reduce; the all-reduce then spread rank {rank}'s non-finite \
                         gradients to the others ({spread:?}) within the same step. It began \
                         in something only rank {rank} computed: its batch.",
                        view.step,
                        ranks.len(),
                        view.reported,
                        name_list(&names, 5),
                        if others.is_empty() {
                            String::new()
                        } else {
                            format!(", also ranks {others:?}")
                        }
                    )
                } else {
                    format!(
                        "At step {}, {} of the {} reporting ranks had NaN or infinite readings \
                         (rank {rank}: {}){}; the others were finite. In data-parallel \
                         training a rank's NaN reaches every rank at the next gradient \
                         all-reduce, so this step shows where it began: something only rank \
                         {rank} computed.",
                        view.step,
                        view.nonfinite_count,
                        view.reported,
                        name_list(&names, 5),
                        if others.is_empty() {
                            String::new()
                        } else {
                            format!(", also ranks {others:?}")
                        }
                    )
                },
                fix: format!(
                    "Look at rank {rank}'s batch at this step (its shard of the dataset: a \
                     corrupt sample, an empty mask, labels out of range) and at code that \
                     runs on that rank alone after backward (a hook, a rank-dependent branch). \
                     Reproduce by training on rank {rank}'s samples in one process under \
                     torch.autograd.set_detect_anomaly(True)."
                ),
                evidence: json!({
                    "cause": "rank_local",
                    "rank": rank,
                    "ranks": ranks.keys().collect::<Vec<_>>(),
                    "ranks_reported": view.reported,
                    "subjects": subjects,
                    "origin": if by_loss { "loss" } else { "readings" },
                    "spread_to": spread,
                }),
            }));
        }
    }

    fn on_divergence(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        let mut diverged: Vec<&Divergence> = view
            .divergences
            .iter()
            .filter(|d| d.series != WEIGHTS_SERIES && d.relative() > DIVERGENCE_TOLERANCE)
            .collect();
        diverged.sort_by(|a, b| b.relative().total_cmp(&a.relative()));
        let streak = &mut self.divergence;
        let Some(worst) = diverged.first() else {
            if streak.open {
                let since = *streak.clear_since.get_or_insert(view.step);
                if view.step + 1 - since >= DIVERGENCE_STEPS {
                    *streak = Streak::default();
                    out.push(Transition::Resolve {
                        kind: AlertKind::ReplicaDivergence,
                        subject: "run".into(),
                        step: view.step,
                    });
                }
            } else {
                *streak = Streak::default();
            }
            return;
        };
        streak.clear_since = None;
        let since = *streak.since.get_or_insert(view.step);
        if streak.open || view.step + 1 - since < DIVERGENCE_STEPS {
            return;
        }
        streak.open = true;
        let names: Vec<String> = diverged
            .iter()
            .map(|d| format!("{} {}", d.subject, d.series))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        out.push(Transition::Open(Opened {
            kind: AlertKind::ReplicaDivergence,
            subject: "run".into(),
            severity: Severity::Critical,
            first_step: Some(since),
            step: Some(view.step),
            title: format!(
                "Replicas disagree: {} differs across ranks ({} apart)",
                worst.subject,
                relative_text(worst.relative())
            ),
            detail: format!(
                "On {} the ranks' values of replicated modules and parameters differ: \
                 {}. Worst: {} {} is {} on rank {} and {} on rank {}. After the gradient \
                 all-reduce every replica holds the same gradient and takes the same \
                 optimizer step, so the replicas have come apart: they now train different \
                 models.",
                step_range(since, view.step),
                name_list(&names, 6),
                worst.subject,
                worst.series,
                sci(worst.min.0),
                worst.min.1,
                sci(worst.max.0),
                worst.max.1
            ),
            fix: "Check that every rank runs backward through the DistributedDataParallel \
                  wrapper on every step (a `model.no_sync()` block left on for the whole step, \
                  or a rank that skips a step, never reduces); that buffers are synchronised \
                  (BatchNorm → SyncBatchNorm, or broadcast_buffers=True); that no module or \
                  parameter is updated outside the wrapper; and that every rank starts from \
                  the same weights and seed."
                .into(),
            evidence: json!({
                "cause": "replicas_disagree",
                "subjects": diverged.iter().take(16).map(|d| json!({
                    "subject": d.subject,
                    "series": d.series,
                    "min": d.min.0, "min_rank": d.min.1,
                    "max": d.max.0, "max_rank": d.max.1,
                    "relative": d.relative(),
                })).collect::<Vec<_>>(),
                "count": diverged.len(),
                "tolerance": DIVERGENCE_TOLERANCE,
            }),
        }));
    }

    /// Replicas' weight fingerprints, judged on the steps that carry them.
    fn on_weights(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        if !view.fingerprinted {
            return;
        }
        let mut diverged: Vec<&Divergence> = view
            .divergences
            .iter()
            .filter(|d| d.series == WEIGHTS_SERIES && d.relative() > DIVERGENCE_TOLERANCE)
            .collect();
        diverged.sort_by(|a, b| b.relative().total_cmp(&a.relative()));
        let streak = &mut self.weights;
        let Some(worst) = diverged.first() else {
            if streak.open {
                out.push(Transition::Resolve {
                    kind: AlertKind::ReplicaDivergence,
                    subject: "weights".into(),
                    step: view.step,
                });
            }
            *streak = Streak::default();
            return;
        };
        let since = *streak.since.get_or_insert(view.step);
        if streak.samples.len() < MAX_SAMPLES {
            streak.samples.push((worst.relative(), 0.0));
        }
        if streak.open || streak.samples.len() < WEIGHTS_READINGS {
            return;
        }
        streak.open = true;
        let names: Vec<&str> = diverged.iter().map(|d| d.subject.as_str()).collect();
        out.push(Transition::Open(Opened {
            kind: AlertKind::ReplicaDivergence,
            subject: "weights".into(),
            severity: Severity::Critical,
            first_step: Some(since),
            step: Some(view.step),
            title: format!(
                "Replicas' weights disagree: {} differs across ranks ({} apart)",
                worst.subject,
                relative_text(worst.relative())
            ),
            detail: format!(
                "On {} the ranks' fingerprints (sums of the weights) of replicated modules \
                 differ: {}. Worst: {}, {} on rank {} and {} on rank {}. The gradients may \
                 still agree — the all-reduce averages them whatever each replica's weights \
                 are — but the replicas have come apart and now train different models.",
                step_range(since, view.step),
                name_list(&names, 6),
                worst.subject,
                sci(worst.min.0),
                worst.min.1,
                sci(worst.max.0),
                worst.max.1
            ),
            fix: "Look for what changes weights on one rank outside the optimizer step: \
                  code that edits parameters (`.data`, `copy_`, a weight clamp or \
                  re-initialisation) only on some ranks, an optimizer or learning-rate \
                  schedule that differs between ranks, a checkpoint loaded on one rank only \
                  after the wrapper broadcast the weights. Broadcast the weights from rank \
                  0 again (or restart from a checkpoint) once the cause is fixed."
                .into(),
            evidence: json!({
                "cause": "replicas_disagree",
                "series": WEIGHTS_SERIES,
                "subjects": diverged.iter().take(16).map(|d| json!({
                    "subject": d.subject,
                    "min": d.min.0, "min_rank": d.min.1,
                    "max": d.max.0, "max_rank": d.max.1,
                    "relative": d.relative(),
                })).collect::<Vec<_>>(),
                "count": diverged.len(),
                "readings": streak.samples.len(),
                "tolerance": DIVERGENCE_TOLERANCE,
            }),
        }));
    }

    fn on_shards(&mut self, view: &RankView, out: &mut Vec<Transition>) {
        let mut by_group: BTreeMap<&str, Vec<&ShardSuspect>> = BTreeMap::new();
        for suspect in &view.shard_suspects {
            by_group.entry(&suspect.group).or_default().push(suspect);
        }
        let healed: Vec<String> = self
            .shards
            .iter()
            .filter(|group| !by_group.contains_key(group.as_str()))
            .cloned()
            .collect();
        for group in healed {
            self.shards.remove(&group);
            out.push(Transition::Resolve {
                kind: AlertKind::ShardReportedAsGlobal,
                subject: group,
                step: view.step,
            });
        }
        for (group, suspects) in by_group {
            if !self.shards.insert(group.to_owned()) {
                continue;
            }
            let first = suspects[0];
            let modules: Vec<&str> = suspects.iter().map(|s| s.module.as_str()).collect();
            out.push(Transition::Open(Opened {
                kind: AlertKind::ShardReportedAsGlobal,
                subject: group.to_owned(),
                severity: Severity::Critical,
                first_step: Some(view.step),
                step: Some(view.step),
                title: format!(
                    "{group}: each rank reports a shard of its parameters as if it were the whole"
                ),
                detail: format!(
                    "Modules of {group} ({}) are registered as replicated, but at step {} \
                     each of {} ranks reported only part of their elements: {} has {} \
                     elements as registered, the ranks reported at most {} each and {} \
                     together. The client read each rank's local shard of a sharded tensor \
                     as the whole tensor, so the norms shown for these modules are one \
                     shard's (off by about √{} when the shards are even), and a rank whose \
                     shard is empty reports a false zero.",
                    name_list(&modules, 5),
                    view.step,
                    first.ranks,
                    first.module,
                    first.registered,
                    first.largest,
                    first.sum,
                    first.ranks
                ),
                fix: "Register these parameters with \"layout\": \"sharded\" (an amendment \
                      in a step record does it while the run trains), so the server adds the \
                      ranks' sums of squares; the gradflow Python client does this for \
                      DTensor parameters under FSDP2. A client that computes norms itself \
                      must reduce the shards' sums of squares (or call full_tensor()) \
                      before taking the square root."
                    .into(),
                evidence: json!({
                    "cause": "local_shard_as_global",
                    "modules": suspects.iter().take(16).map(|s| json!({
                        "module": s.module,
                        "registered_numel": s.registered,
                        "largest_rank_numel": s.largest,
                        "sum_of_rank_numel": s.sum,
                        "ranks": s.ranks,
                    })).collect::<Vec<_>>(),
                    "count": suspects.len(),
                }),
            }));
        }
    }
}

/// One straggler-streak step of `rank`; the transition it makes, if any.
fn straggler_step(
    streak: &mut Streak,
    rank: u32,
    view: &RankView,
    slow: bool,
    time: f64,
    median: f64,
) -> Option<Transition> {
    if !slow {
        if !streak.open {
            *streak = Streak::default();
            return None;
        }
        let since = *streak.clear_since.get_or_insert(view.step);
        if view.step + 1 - since < STRAGGLER_STEPS {
            return None;
        }
        *streak = Streak::default();
        return Some(Transition::Resolve {
            kind: AlertKind::RankStraggler,
            subject: rank_subject(rank),
            step: view.step,
        });
    }
    streak.clear_since = None;
    let since = *streak.since.get_or_insert(view.step);
    if streak.samples.len() < MAX_SAMPLES {
        streak.samples.push((time, median));
    }
    if streak.open || view.step + 1 - since < STRAGGLER_STEPS {
        return None;
    }
    streak.open = true;
    let median_of = |pick: fn(&(f64, f64)) -> f64| {
        let mut values: Vec<f64> = streak.samples.iter().map(pick).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let own = median_of(|s| s.0);
    let others = median_of(|s| s.1);
    Some(Transition::Open(Opened {
        kind: AlertKind::RankStraggler,
        subject: rank_subject(rank),
        severity: Severity::Warning,
        first_step: Some(since),
        step: Some(view.step),
        title: format!(
            "Rank {rank} is a straggler: {:.0} ms a step against {:.0} ms on the other ranks",
            own * 1e3,
            others * 1e3
        ),
        detail: format!(
            "Over {} rank {rank} spent a median {:.1} ms of its own work on each step, {:.1}× \
             the other ranks' {:.1} ms. In lockstep data parallelism every rank waits for it \
             at each gradient all-reduce, so the whole run goes at its pace: about {:.0} % of \
             each step is the others waiting.",
            step_range(since, view.step),
            own * 1e3,
            own / others,
            others * 1e3,
            (1.0 - others / own) * 100.0
        ),
        fix: format!(
            "Find what only rank {rank} does more of: its data loader (fewer workers, a slower \
             disk or a longer shard of variable-length samples), a slower or throttled device \
             (check its temperature and clocks), another process on its GPU or CPU, or extra \
             work on that rank (logging, checkpointing, evaluation on rank {rank} only)."
        ),
        evidence: json!({
            "cause": "slow_rank",
            "rank": rank,
            "step_time_ms": own * 1e3,
            "others_median_ms": others * 1e3,
            "ratio": own / others,
            "steps": view.step + 1 - since,
        }),
    }))
}

/// "3.2 %" or "2.1e-3 %".
fn relative_text(relative: f64) -> String {
    let percent = relative * 100.0;
    if percent >= 0.1 {
        format!("{percent:.1} %")
    } else {
        format!("{} %", sci(percent))
    }
}

/// Resolves the open per-rank episodes of `kind` whose rank no longer meets the
/// condition (`still` says which ranks do), forgetting them.
fn resolve_ranks_gone(
    open: &mut BTreeMap<u32, u64>,
    still: impl Fn(&u32) -> bool,
    kind: AlertKind,
    step: u64,
    out: &mut Vec<Transition>,
) {
    open.retain(|rank, _| {
        if still(rank) {
            return true;
        }
        out.push(Transition::Resolve {
            kind,
            subject: rank_subject(*rank),
            step,
        });
        false
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(step: u64) -> RankView {
        RankView {
            step,
            world_size: 4,
            reported: 4,
            ..RankView::default()
        }
    }

    /// Step `step` of four ranks, completed without `rank` (last seen at `last`).
    fn missing(step: u64, rank: u32, last: u64) -> RankView {
        RankView {
            reported: 3,
            missing: vec![(rank, Some(last))],
            ..view(step)
        }
    }

    /// Runs `steps` through `detectors`, each view shaped by `shape`; collects the
    /// transitions in `all` and returns (step, opened) for each.
    fn drive(
        detectors: &mut RankDetectors,
        all: &mut Vec<(u64, Transition)>,
        steps: std::ops::Range<u64>,
        shape: impl Fn(u64, &mut RankView),
    ) -> Vec<(u64, bool)> {
        for step in steps {
            let mut v = view(step);
            shape(step, &mut v);
            let mut out = Vec::new();
            detectors.on_step(&v, &mut out);
            all.extend(out.into_iter().map(|t| (step, t)));
        }
        all.iter()
            .map(|(s, t)| (*s, matches!(t, Transition::Open(_))))
            .collect()
    }

    fn opened(out: &[Transition]) -> Vec<(AlertKind, String)> {
        out.iter()
            .filter_map(|t| match t {
                Transition::Open(o) => Some((o.kind, o.subject.clone())),
                Transition::Resolve { .. } => None,
            })
            .collect()
    }

    fn resolved(out: &[Transition]) -> Vec<(AlertKind, String, u64)> {
        out.iter()
            .filter_map(|t| match t {
                Transition::Resolve {
                    kind,
                    subject,
                    step,
                } => Some((*kind, subject.clone(), *step)),
                Transition::Open(_) => None,
            })
            .collect()
    }

    #[test]
    fn a_healthy_run_of_equal_ranks_is_silent() {
        let mut detectors = RankDetectors::default();
        for step in 0..200 {
            let mut v = view(step);
            // Noisy but even step times; identical replicated values.
            v.step_times = (0..4)
                .map(|r| (r, 0.1 + 0.01 * (((step * 7 + r as u64) % 5) as f64)))
                .collect();
            v.divergences = vec![Divergence {
                subject: "agent.head".into(),
                series: "grad_norm",
                min: (0.5, 0),
                max: (0.5, 3),
            }];
            let mut out = Vec::new();
            detectors.on_step(&v, &mut out);
            assert!(out.is_empty(), "step {step}: {out:?}");
        }
    }

    #[test]
    fn a_missing_rank_opens_once_and_resolves_when_back() {
        let mut detectors = RankDetectors::default();
        let mut out = Vec::new();
        detectors.on_step(&missing(10, 2, 7), &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankMissing, "rank 2".to_owned())]
        );
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(o.evidence["last_step"], 7);
        out.clear();
        detectors.on_step(&missing(11, 2, 7), &mut out);
        assert!(out.is_empty(), "{out:?}");
        detectors.on_step(&view(12), &mut out);
        assert_eq!(
            resolved(&out),
            [(AlertKind::RankMissing, "rank 2".to_owned(), 12)]
        );
    }

    #[test]
    fn a_slow_rank_is_named_after_ten_steps_and_cleared_after_ten() {
        let mut detectors = RankDetectors::default();
        let mut all = Vec::new();
        for step in 0..40 {
            let slow = step < 20;
            let mut v = view(step);
            v.step_times = (0..4)
                .map(|r| (r, if r == 1 && slow { 0.3 } else { 0.1 }))
                .collect();
            let mut out = Vec::new();
            detectors.on_step(&v, &mut out);
            all.extend(out.into_iter().map(|t| (step, t)));
        }
        let opens: Vec<u64> = all
            .iter()
            .filter(|(_, t)| matches!(t, Transition::Open(_)))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(opens, [9], "{all:?}");
        let Transition::Open(o) = &all[0].1 else {
            unreachable!()
        };
        assert_eq!(o.subject, "rank 1");
        assert!((o.evidence["ratio"].as_f64().unwrap() - 3.0).abs() < 1e-9);
        let resolves: Vec<u64> = all
            .iter()
            .filter(|(_, t)| matches!(t, Transition::Resolve { .. }))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(resolves, [29]);
    }

    #[test]
    fn tiny_steps_do_not_make_stragglers_of_noise() {
        let mut detectors = RankDetectors::default();
        for step in 0..50 {
            let mut v = view(step);
            // 2× slower, but only by 1 ms.
            v.step_times = vec![(0, 0.001), (1, 0.002), (2, 0.001), (3, 0.001)];
            let mut out = Vec::new();
            detectors.on_step(&v, &mut out);
            assert!(out.is_empty(), "{out:?}");
        }
    }

    #[test]
    fn nan_on_one_rank_names_it_and_spreading_to_all_keeps_it_open() {
        let mut detectors = RankDetectors::default();
        let mut out = Vec::new();
        let mut v = view(30);
        v.nonfinite = vec![(1, vec!["loss".into(), "agent.head".into()])];
        v.nonfinite_count = 1;
        detectors.on_step(&v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankNonfinite, "rank 1".to_owned())]
        );
        out.clear();
        // The next step every rank is NaN: nothing new, rank 1 stays open.
        let mut v = view(31);
        v.nonfinite = (0..4).map(|r| (r, vec!["loss".into()])).collect();
        v.nonfinite_count = 4;
        detectors.on_step(&v, &mut out);
        assert!(out.is_empty(), "{out:?}");
        detectors.on_step(&view(32), &mut out);
        assert_eq!(
            resolved(&out),
            [(AlertKind::RankNonfinite, "rank 1".to_owned(), 32)]
        );
    }

    #[test]
    fn nan_spread_within_the_step_is_traced_to_the_rank_whose_loss_is_not_finite() {
        let mut detectors = RankDetectors::default();
        let mut out = Vec::new();
        // Every rank's gradients are NaN (the all-reduce spread them), only rank 1's
        // own loss is.
        let mut v = view(10);
        v.nonfinite = vec![
            (0, vec!["agent.head".into()]),
            (1, vec!["loss".into(), "agent.head".into()]),
            (2, vec!["agent.head".into()]),
            (3, vec!["agent.head".into()]),
        ];
        v.nonfinite_count = 4;
        v.loss_nonfinite = vec![1];
        detectors.on_step(&v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::RankNonfinite, "rank 1".to_owned())]
        );
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(o.evidence["origin"], "loss");
        assert_eq!(o.evidence["spread_to"], json!([0, 2, 3]));
        out.clear();
        // Then every loss is NaN too: nothing new.
        let mut v = view(11);
        v.nonfinite = (0..4).map(|r| (r, vec!["loss".into()])).collect();
        v.nonfinite_count = 4;
        v.loss_nonfinite = vec![0, 1, 2, 3];
        detectors.on_step(&v, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn a_closed_rank_s_missing_steps_say_it_closed() {
        let mut detectors = RankDetectors::default();
        let mut out = Vec::new();
        let v = RankView {
            closed: vec![1],
            ..missing(21, 1, 20)
        };
        detectors.on_step(&v, &mut out);
        let Transition::Open(o) = &out[0] else {
            unreachable!()
        };
        assert_eq!(
            (o.kind, o.subject.as_str()),
            (AlertKind::RankMissing, "rank 1")
        );
        assert_eq!(o.evidence["closed"], true);
        assert_eq!(o.evidence["last_step"], 20);
        assert!(o.detail.contains("closed"), "{}", o.detail);
    }

    #[test]
    fn nan_on_every_rank_at_once_is_not_rank_local() {
        let mut detectors = RankDetectors::default();
        let mut out = Vec::new();
        let mut v = view(5);
        v.nonfinite = (0..4).map(|r| (r, vec!["loss".into()])).collect();
        v.nonfinite_count = 4;
        detectors.on_step(&v, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn disagreeing_replicas_open_after_three_steps() {
        let mut detectors = RankDetectors::default();
        let mut all = Vec::new();
        let steps = drive(&mut detectors, &mut all, 0..10, |step, v| {
            if (2..7).contains(&step) {
                v.divergences = vec![Divergence {
                    subject: "agent.head".into(),
                    series: "grad_norm",
                    min: (0.5, 0),
                    max: (0.51, 1),
                }];
            }
        });
        assert_eq!(steps, [(4, true), (9, false)], "{all:?}");
    }

    #[test]
    fn weights_that_come_apart_open_on_two_readings_and_steps_between_do_not_count() {
        let mut detectors = RankDetectors::default();
        let mut all = Vec::new();
        // Fingerprints every 5 steps; from step 10 rank 1's weights are off.
        let steps = drive(&mut detectors, &mut all, 0..40, |step, v| {
            if step % 5 == 0 {
                v.fingerprinted = true;
                let off = if (10..30).contains(&step) { 0.01 } else { 0.0 };
                v.divergences = vec![Divergence {
                    subject: "agent.head".into(),
                    series: WEIGHTS_SERIES,
                    min: (0.5, 0),
                    max: (0.5 + off, 1),
                }];
            }
        });
        assert_eq!(steps, [(15, true), (30, false)], "{all:?}");
        let Transition::Open(o) = &all[0].1 else {
            unreachable!()
        };
        assert_eq!((o.subject.as_str(), o.first_step), ("weights", Some(10)));
        assert_eq!(o.evidence["subjects"][0]["max_rank"], 1);
    }

    #[test]
    fn shards_reported_as_whole_tensors_are_one_alert_per_group() {
        let mut detectors = RankDetectors::default();
        let mut out = Vec::new();
        let mut v = view(0);
        v.shard_suspects = ["a.q", "a.k"]
            .iter()
            .map(|m| ShardSuspect {
                module: (*m).into(),
                group: "a".into(),
                registered: 64,
                largest: 16,
                sum: 64,
                ranks: 4,
            })
            .collect();
        detectors.on_step(&v, &mut out);
        assert_eq!(
            opened(&out),
            [(AlertKind::ShardReportedAsGlobal, "a".to_owned())]
        );
        out.clear();
        detectors.on_step(&v, &mut out);
        assert!(out.is_empty());
    }
}
