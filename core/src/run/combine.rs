//! Combining the ranks of a multi-rank run (v1.4): every rank sends its own record
//! of each step, and the run's step is what they say together.
//!
//! Each rank's record is stored in its own stream as it arrives, and folded into
//! an accumulator of its step: per column, what the combination needs (a sum of
//! squares, a sum and a count, the lowest rank's value, extremes with their ranks),
//! so a step waiting for its last ranks holds one accumulator whatever the world
//! size, not every rank's record. A step is combined once every rank's record has
//! arrived, or when it cannot wait longer: the other ranks got [`LAG_STEPS`] steps
//! ahead, or it has waited the server's rank timeout. Steps combine in order.
//!
//! How a column combines follows from what it measures and how its parameters are
//! laid out:
//!
//! - gradient and update norms of a `sharded` module or parameter: the square root
//!   of the ranks' summed squares (each rank holds a shard); of a `replicated` one:
//!   the lowest rank's (after the all-reduce they are the same, and whether they
//!   are is what `replica_divergence` checks);
//! - a sharded parameter's drift and largest intended ulp: the largest; its mean:
//!   the mean weighted by each rank's elements; its element counts and (v1.5) the
//!   sums of its weights, a module's fingerprint: the sum (replicated: the lowest
//!   rank's, the others compared);
//! - the loss and other metrics: the mean over ranks (a NaN on any rank is a NaN);
//! - hook hits: the fewest (backward reached the module on every rank);
//! - the scaler's overflow and skip flags, step time, input maximum, devices: the
//!   largest; the scale and lr: the lowest rank's; dropped steps: the sum.
//!
//! The accumulators fold the cells as stored, so a server that reads a run's state
//! back (another replica moved it on) folds the ranks' stored rows into exactly
//! the accumulators the server that received them had.

use std::collections::BTreeMap;

use gradflow_protocol::GraphCut;

use super::registry::Registry;
use crate::columnar::columns::ColumnDictionary;
use crate::detect::ranks::{
    Divergence, RankView, SHARD_SUM_TOLERANCE, ShardSuspect, WEIGHTS_SERIES,
};
use crate::model::cell::{ABSENT_BITS, Cell, to_stored_f32};
use crate::model::series_kind::SeriesKind;

/// A step waits at most until some rank is this many steps past it.
pub const LAG_STEPS: u64 = 256;
/// Ranks named with their non-finite subjects in one step's view, at most.
const MAX_NONFINITE_RANKS: usize = 16;
/// Subjects named per rank, at most.
const MAX_NONFINITE_SUBJECTS: usize = 5;
/// Graph cuts kept per waiting step, at most.
const MAX_CUTS: usize = 64;

/// How a column's values from several ranks become the run's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Mean,
    Lowest,
    RootSumSquares,
    Sum,
    Max,
    Min,
    WeightedMean,
    /// The root of the mean of squares, each rank weighted by its elements (an RMS
    /// over shards).
    WeightedRms,
    /// Not combined: derived from the combined record (group norms).
    Derived,
}

fn rule(kind: SeriesKind, sharded: bool) -> Rule {
    use SeriesKind::*;
    match kind {
        Loss | Metric => Rule::Mean,
        Lr | ScalerScale | ScalerGrowthTracker => Rule::Lowest,
        FoundInf | StepSkipped | GradsCarriedOver | LocalGradsNonfinite | InputAbsmax
        | OptimizerSteps | StepTime | GpuMemoryUsedBytes | GpuMemoryTotalBytes
        | GpuUtilizationPct | GpuTemperatureC | GpuPowerW => Rule::Max,
        DroppedSteps | ModuleNonfinite => Rule::Sum,
        HookHits => Rule::Min,
        GroupGradNorm => Rule::Derived,
        ModuleGradNorm | ParamGradNorm | UpdateNorm | IntendedUpdateNorm => {
            if sharded {
                Rule::RootSumSquares
            } else {
                Rule::Lowest
            }
        }
        Drift | IntendedUpdateMaxUlp => {
            if sharded {
                Rule::Max
            } else {
                Rule::Lowest
            }
        }
        ParamMean => {
            if sharded {
                Rule::WeightedMean
            } else {
                Rule::Lowest
            }
        }
        IntendedNonzero | RoundedAway | ModuleNumel | ParamNumel | ModuleParamSum => {
            if sharded {
                Rule::Sum
            } else {
                Rule::Lowest
            }
        }
        AttnMaxLogit | AttnMinEntropy | ActRms | ActAbsmax | AdamUpdated | AdamBelowEps
        | AdamUpdateRms | AdamUpdateAbsmax | OutputLogzMean | OutputLogitAbsmax
        | MoeExpertTokens | MoeRouterZ | MoeTopShare | MoeMaxVio | MoeIdleExperts | MicroLoss
        | RepeatedTokenShare | OutputLogitMean => signal_rule(kind, sharded),
    }
}

/// How the v1.8 signals combine. Ranks see different batches, so the statistics of
/// what a batch does (attention, activations, output logits, micro-batch losses) keep
/// their extreme, the one a verdict is about: the largest logit, activation and
/// micro-batch loss, the smallest entropy; the mean log Z is the ranks' mean. Adam's
/// state is the optimizer's: a replicated module's is every rank's (the lowest
/// rank's is kept), a sharded one's adds up over the shards. Expert loads add up
/// (each rank routes its own tokens); the loads' summaries are derived again from
/// the sums.
fn signal_rule(kind: SeriesKind, sharded: bool) -> Rule {
    use SeriesKind::*;
    let per_shard = |rule: Rule| if sharded { rule } else { Rule::Lowest };
    match kind {
        AttnMaxLogit | ActRms | ActAbsmax | OutputLogitAbsmax | MicroLoss | RepeatedTokenShare => {
            Rule::Max
        }
        AttnMinEntropy => Rule::Min,
        OutputLogzMean | OutputLogitMean | MoeRouterZ => Rule::Mean,
        MoeExpertTokens => Rule::Sum,
        MoeTopShare | MoeMaxVio | MoeIdleExperts => Rule::Derived,
        AdamUpdated => per_shard(Rule::Sum),
        AdamBelowEps => per_shard(Rule::WeightedMean),
        AdamUpdateRms => per_shard(Rule::WeightedRms),
        AdamUpdateAbsmax => per_shard(Rule::Max),
        // Not a v1.8 signal: `rule` never asks.
        _ => Rule::Lowest,
    }
}

/// The column whose value weighs a rank's value of `kind` in a weighted rule: the
/// elements it covers.
fn weight_kind(kind: SeriesKind) -> SeriesKind {
    match kind {
        SeriesKind::AdamBelowEps | SeriesKind::AdamUpdateRms => SeriesKind::AdamUpdated,
        _ => SeriesKind::ParamNumel,
    }
}

/// Whether the subject of a column of `kind` is laid out sharded.
fn sharded(kind: SeriesKind, subject: &str, registry: &Registry) -> bool {
    use SeriesKind::*;
    match kind {
        ModuleGradNorm | HookHits | ModuleNumel | ModuleNonfinite | ModuleParamSum
        | AdamUpdated | AdamBelowEps | AdamUpdateRms | AdamUpdateAbsmax => {
            registry.sharded_modules.contains(subject)
        }
        ParamGradNorm | UpdateNorm | Drift | ParamMean | IntendedUpdateNorm
        | IntendedUpdateMaxUlp | IntendedNonzero | RoundedAway | ParamNumel => {
            registry.sharded_params.contains(subject)
        }
        _ => false,
    }
}

/// Whether replicas of a column's subject are compared (what `replica_divergence`
/// reads): the gradient and update norms, the weights' means and (v1.5) the
/// modules' weight fingerprints.
fn compared(kind: SeriesKind) -> Option<&'static str> {
    match kind {
        SeriesKind::ModuleGradNorm => Some("grad_norm"),
        SeriesKind::ParamGradNorm => Some("param_grad_norm"),
        SeriesKind::UpdateNorm => Some("update_norm"),
        SeriesKind::ParamMean => Some("param_mean"),
        SeriesKind::ModuleParamSum => Some(WEIGHTS_SERIES),
        _ => None,
    }
}

/// A set of ranks, one bit each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankSet(Vec<u64>);

impl RankSet {
    pub fn insert(&mut self, rank: u32) -> bool {
        let (word, bit) = (rank as usize / 64, rank % 64);
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        let new = self.0[word] & (1 << bit) == 0;
        self.0[word] |= 1 << bit;
        new
    }

    pub fn contains(&self, rank: u32) -> bool {
        self.0
            .get(rank as usize / 64)
            .is_some_and(|w| w & (1 << (rank % 64)) != 0)
    }

    pub fn len(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
}

/// What one column of one waiting step has gathered from its ranks.
#[derive(Debug, Clone, Copy)]
struct ColumnAcc {
    /// A sum (of values, squares, or weighted values, as the rule says).
    sum: f64,
    /// A count, or the sum of weights.
    weight: f64,
    values: u32,
    nulls: u32,
    /// The lowest rank that reported the column, and its cell.
    lowest: Option<(u32, u32)>,
    /// Extremes of the finite values, with a rank that had each.
    min: Option<(f64, u32)>,
    max: Option<(f64, u32)>,
}

impl ColumnAcc {
    const EMPTY: ColumnAcc = ColumnAcc {
        sum: 0.0,
        weight: 0.0,
        values: 0,
        nulls: 0,
        lowest: None,
        min: None,
        max: None,
    };
}

/// One step of a multi-rank run while its ranks' records arrive.
#[derive(Debug, Clone)]
pub struct PendingStep {
    pub arrived: RankSet,
    /// Server clock when its first record arrived.
    pub first_seen: f64,
    /// The latest of the ranks' timestamps.
    time: Option<f64>,
    columns: Vec<ColumnAcc>,
    nonfinite: Vec<(u32, Vec<String>)>,
    nonfinite_ranks: u32,
    /// Ranks whose own loss was not finite (all of them: how many tells whether
    /// they are some ranks or every one).
    loss_nonfinite: Vec<u32>,
    /// Ranks whose own gradients were not finite before the all-reduce (v1.7).
    local_grads_nonfinite: Vec<u32>,
    /// Whether a rank's loss scaler found non-finite gradients and skipped the step.
    scaler_skipped: bool,
    /// Each rank's own finite loss (before the mean).
    losses: Vec<(u32, f64)>,
    step_times: Vec<(u32, f64)>,
    graph_cuts: Vec<GraphCut>,
}

/// A step combined from its ranks.
#[derive(Debug, Clone)]
pub struct Combined {
    pub step: u64,
    pub time: Option<f64>,
    /// The run's cells for the step (group norms left to the record's flattening).
    pub cells: Vec<u32>,
    pub graph_cuts: Vec<GraphCut>,
    /// What the ranks showed together (the caller names the missing ranks).
    pub view: RankView,
}

impl PendingStep {
    pub fn new(first_seen: f64) -> PendingStep {
        PendingStep {
            arrived: RankSet::default(),
            first_seen,
            time: None,
            columns: Vec::new(),
            nonfinite: Vec::new(),
            nonfinite_ranks: 0,
            loss_nonfinite: Vec::new(),
            local_grads_nonfinite: Vec::new(),
            scaler_skipped: false,
            losses: Vec::new(),
            step_times: Vec::new(),
            graph_cuts: Vec::new(),
        }
    }

    /// Folds rank `rank`'s row in (its first record of the step; a second is a
    /// duplicate the caller has dropped).
    pub fn fold(
        &mut self,
        rank: u32,
        cells: &[u32],
        time: Option<f64>,
        graph_cuts: &[GraphCut],
        columns: &ColumnDictionary,
        registry: &Registry,
    ) {
        if !self.arrived.insert(rank) {
            return;
        }
        if let Some(time) = time {
            self.time = Some(self.time.map_or(time, |t: f64| t.max(time)));
        }
        if self.columns.len() < cells.len() {
            self.columns.resize(cells.len(), ColumnAcc::EMPTY);
        }
        let mut nonfinite: Vec<String> = Vec::new();
        let mut any_nonfinite = false;
        for (position, &bits) in cells.iter().enumerate() {
            if bits == ABSENT_BITS {
                continue;
            }
            let Some((kind, subject)) = columns.entry(position) else {
                continue;
            };
            let cell = Cell::from_bits(bits);
            let value = match cell {
                Cell::Value(v) => Some(f64::from(v)),
                _ => None,
            };
            let flags_nonfinite = match kind {
                SeriesKind::Loss | SeriesKind::ModuleGradNorm | SeriesKind::ParamGradNorm => {
                    value.is_some_and(|v| !v.is_finite())
                }
                SeriesKind::ModuleNonfinite => value.is_some_and(|v| v > 0.0),
                _ => false,
            };
            // What says where a NaN began: this rank's own loss and gradients, and
            // whether its loss scaler skipped the step.
            let set = value.is_some_and(|v| v > 0.0);
            match kind {
                SeriesKind::Loss if flags_nonfinite => self.loss_nonfinite.push(rank),
                SeriesKind::Loss => self.losses.extend(value.map(|v| (rank, v))),
                SeriesKind::LocalGradsNonfinite if set => self.local_grads_nonfinite.push(rank),
                SeriesKind::FoundInf | SeriesKind::StepSkipped if set => self.scaler_skipped = true,
                _ => {}
            }
            if flags_nonfinite {
                any_nonfinite = true;
                let name = if subject.is_empty() {
                    kind.as_str()
                } else {
                    subject
                };
                if nonfinite.len() < MAX_NONFINITE_SUBJECTS && !nonfinite.iter().any(|n| n == name)
                {
                    nonfinite.push(name.to_owned());
                }
            }
            if kind == SeriesKind::StepTime
                && let Some(v) = value
            {
                self.step_times.push((rank, v));
            }
            let rule = rule(kind, sharded(kind, subject, registry));
            let acc = &mut self.columns[position];
            let Some(v) = value else {
                if cell == Cell::Null {
                    acc.nulls += 1;
                }
                if rule == Rule::Lowest && acc.lowest.is_none_or(|(r, _)| rank < r) {
                    acc.lowest = Some((rank, bits));
                }
                continue;
            };
            acc.values += 1;
            if v.is_finite() {
                if acc.min.is_none_or(|(m, _)| v < m) {
                    acc.min = Some((v, rank));
                }
                if acc.max.is_none_or(|(m, _)| v > m) {
                    acc.max = Some((v, rank));
                }
            }
            match rule {
                Rule::Mean | Rule::Sum => acc.sum += v,
                Rule::RootSumSquares => acc.sum += v * v,
                Rule::Max => {
                    if v.is_nan() || acc.values == 1 || v > acc.sum {
                        acc.sum = if acc.sum.is_nan() { acc.sum } else { v };
                    }
                }
                Rule::Min => {
                    if acc.values == 1 || v < acc.sum {
                        acc.sum = v;
                    }
                }
                Rule::WeightedMean | Rule::WeightedRms => {
                    let weight = columns
                        .get(weight_kind(kind), subject)
                        .and_then(|p| cells.get(p as usize))
                        .and_then(|b| match Cell::from_bits(*b) {
                            Cell::Value(w) if w > 0.0 => Some(f64::from(w)),
                            _ => None,
                        })
                        .unwrap_or(1.0);
                    let v = if rule == Rule::WeightedRms { v * v } else { v };
                    acc.sum += v * weight;
                    acc.weight += weight;
                }
                Rule::Lowest => {
                    // The sum is not the cell, but says what the ranks' element
                    // counts add up to (`shard_reported_as_global`).
                    acc.sum += v;
                    if acc.lowest.is_none_or(|(r, _)| rank < r) {
                        acc.lowest = Some((rank, bits));
                    }
                }
                Rule::Derived => {}
            }
        }
        if any_nonfinite {
            self.nonfinite_ranks += 1;
            if self.nonfinite.len() < MAX_NONFINITE_RANKS {
                self.nonfinite.push((rank, nonfinite));
            }
        }
        for cut in graph_cuts {
            if self.graph_cuts.len() < MAX_CUTS
                && !self.graph_cuts.iter().any(|c| c.module == cut.module)
            {
                self.graph_cuts.push(cut.clone());
            }
        }
    }

    /// The step as its ranks say it together.
    pub fn combine(
        self,
        step: u64,
        world_size: u32,
        columns: &ColumnDictionary,
        registry: &Registry,
    ) -> Combined {
        let mut cells = vec![ABSENT_BITS; self.columns.len()];
        let mut divergences = Vec::new();
        let mut shard_suspects = Vec::new();
        let mut fingerprinted = false;
        for (position, acc) in self.columns.iter().enumerate() {
            let Some((kind, subject)) = columns.entry(position) else {
                continue;
            };
            let sharded = sharded(kind, subject, registry);
            let rule = rule(kind, sharded);
            let cell = if acc.values == 0 {
                match (rule, acc.lowest) {
                    (Rule::Lowest, Some((_, bits))) => Cell::from_bits(bits),
                    _ if acc.nulls > 0 => Cell::Null,
                    _ => Cell::Absent,
                }
            } else {
                match rule {
                    Rule::Mean => Cell::Value(to_stored_f32(acc.sum / f64::from(acc.values))),
                    Rule::Sum | Rule::Max | Rule::Min => Cell::Value(to_stored_f32(acc.sum)),
                    Rule::RootSumSquares => Cell::Value(to_stored_f32(acc.sum.sqrt())),
                    Rule::WeightedMean => Cell::Value(to_stored_f32(acc.sum / acc.weight)),
                    Rule::WeightedRms => Cell::Value(to_stored_f32((acc.sum / acc.weight).sqrt())),
                    Rule::Lowest => acc
                        .lowest
                        .map_or(Cell::Absent, |(_, bits)| Cell::from_bits(bits)),
                    Rule::Derived => Cell::Absent,
                }
            };
            cells[position] = cell.to_bits();
            if !sharded
                && let (Some(series), Some(min), Some(max)) = (compared(kind), acc.min, acc.max)
                && acc.values >= 2
            {
                fingerprinted |= kind == SeriesKind::ModuleParamSum;
                divergences.push(Divergence {
                    subject: subject.to_owned(),
                    series,
                    min,
                    max,
                });
            }
            if kind == SeriesKind::ModuleNumel
                && !sharded
                && acc.values >= 2
                && let (Some(&registered), Some((largest, _))) =
                    (registry.module_numel.get(subject), acc.max)
            {
                let sum = acc.sum.round() as u64;
                let largest = largest as u64;
                if largest < registered
                    && (sum as f64 - registered as f64).abs()
                        <= SHARD_SUM_TOLERANCE * registered as f64
                {
                    shard_suspects.push(ShardSuspect {
                        module: subject.to_owned(),
                        group: registry
                            .module_groups
                            .get(subject)
                            .cloned()
                            .unwrap_or_else(|| {
                                gradflow_protocol::default_group(subject).to_owned()
                            }),
                        registered,
                        largest,
                        sum,
                        ranks: acc.values,
                    });
                }
            }
        }
        let reported = self.arrived.len();
        Combined {
            step,
            time: self.time,
            cells,
            graph_cuts: self.graph_cuts,
            view: RankView {
                step,
                world_size,
                reported,
                missing: Vec::new(),
                step_times: self.step_times,
                nonfinite: self.nonfinite,
                nonfinite_count: self.nonfinite_ranks,
                divergences,
                shard_suspects,
                closed: Vec::new(),
                loss_nonfinite: self.loss_nonfinite,
                local_grads_nonfinite: self.local_grads_nonfinite,
                scaler_skipped: self.scaler_skipped,
                losses: self.losses,
                fingerprinted,
            },
        }
    }
}

/// The waiting steps of a multi-rank run.
pub type Pending = BTreeMap<u64, PendingStep>;

#[cfg(test)]
mod tests {
    use gradflow_protocol::{RunRegistration, StepRecord};
    use serde_json::{Value, json};

    use super::*;
    use crate::columnar::columns::ColumnAssigner;
    use crate::columnar::flatten::{flatten, unflatten};
    use crate::detect::thresholds::Thresholds;

    /// Two ranks: `qwen.q` sharded across them (8 elements), `agent.head` replicated
    /// (4 elements).
    fn registry() -> Registry {
        let registration: RunRegistration = serde_json::from_value(json!({
            "world_size": 2,
            "params": [
                {"name": "qwen.q.weight", "shape": [8], "layout": "sharded", "shard_ranks": [0, 1]},
                {"name": "agent.head.weight", "shape": [4]}
            ]
        }))
        .unwrap();
        Registry::new(registration.normalized(), Thresholds::default())
    }

    /// Each rank's record of step 7 folded in rank order, then combined: the run's
    /// step as a record, and what the ranks showed together.
    fn combine(records: &[Value]) -> (StepRecord, RankView) {
        let registry = registry();
        let mut columns = ColumnDictionary::default();
        let mut pending = PendingStep::new(0.0);
        for value in records {
            let record: StepRecord = serde_json::from_value(value.clone()).unwrap();
            let mut assigner = ColumnAssigner::new(&columns);
            let cells = flatten(&record, &registry.module_groups, &mut assigner);
            for (kind, subject, position) in assigner.added() {
                columns.restore(kind, &subject, position);
            }
            let rank = record.rank.unwrap();
            pending.fold(rank, &cells, None, &record.graph_cuts, &columns, &registry);
        }
        let combined = pending.combine(7, 2, &columns, &registry);
        (
            unflatten(combined.step, &combined.cells, &columns),
            combined.view,
        )
    }

    fn rank(rank: u32, loss: Value, qwen: f64, head: f64) -> Value {
        json!({"step": 7, "rank": rank, "loss": loss, "modules": [
            {"module": "qwen.q", "grad_sumsq": qwen * qwen, "hook_hits": 1 - rank.min(1), "numel": 4},
            {"module": "agent.head", "grad_norm": head, "hook_hits": 1, "numel": 4}
        ]})
    }

    fn module<'a>(record: &'a StepRecord, name: &str) -> &'a gradflow_protocol::ModuleStep {
        record.modules.iter().find(|m| m.module == name).unwrap()
    }

    #[test]
    fn each_column_combines_by_what_it_measures_and_its_layout() {
        let (record, view) =
            combine(&[rank(0, json!(2.0), 3.0, 0.5), rank(1, json!(4.0), 4.0, 0.5)]);
        // The loss: the mean over ranks.
        assert_eq!(record.loss.map(|l| l.get()), Some(3.0));
        // A sharded module: the root of the ranks' summed squares; hook hits: the
        // fewest (backward reached it on every rank, or not).
        let qwen = module(&record, "qwen.q");
        assert_eq!(qwen.grad_norm.map(|n| n.get()), Some(5.0));
        assert_eq!(qwen.hook_hits, Some(0));
        assert_eq!(qwen.numel, Some(8));
        // A replicated one: the lowest rank's, compared across ranks.
        let head = module(&record, "agent.head");
        assert_eq!(head.grad_norm.map(|n| n.get()), Some(0.5));
        let compared: Vec<(&str, f64)> = view
            .divergences
            .iter()
            .map(|d| (d.subject.as_str(), d.relative()))
            .collect();
        assert_eq!(compared, [("agent.head", 0.0)]);
        assert_eq!(
            (view.reported, view.world_size, view.nonfinite_count),
            (2, 2, 0)
        );
        // Each rank held the whole replicated module (4 of 4): not a shard.
        assert!(view.shard_suspects.is_empty());
    }

    #[test]
    fn replicas_that_disagree_and_a_nan_on_one_rank_are_in_the_view() {
        let (record, view) = combine(&[
            rank(0, json!(2.0), 3.0, 0.5),
            rank(1, json!("NaN"), 4.0, 0.6),
        ]);
        assert!(record.loss.is_some_and(|l| l.get().is_nan()));
        let head = &view.divergences[0];
        assert_eq!(
            (head.subject.as_str(), head.series),
            ("agent.head", "grad_norm")
        );
        assert_eq!((head.min, head.max), ((0.5, 0), (0.6000000238418579, 1)));
        assert!((head.relative() - 1.0 / 6.0).abs() < 1e-6);
        assert_eq!(view.nonfinite, [(1, vec!["loss".to_owned()])]);
        assert_eq!(view.loss_nonfinite, [1]);
    }

    #[test]
    fn ranks_that_each_report_part_of_a_replicated_module_are_a_shard_suspect() {
        let half = |r: u32| {
            json!({"step": 7, "rank": r, "loss": 1.0, "modules": [
                {"module": "agent.head", "grad_norm": 0.5, "numel": 2}]})
        };
        let (_, view) = combine(&[half(0), half(1)]);
        let suspect = &view.shard_suspects[0];
        assert_eq!(
            (suspect.module.as_str(), suspect.group.as_str()),
            ("agent.head", "agent")
        );
        assert_eq!(
            (
                suspect.registered,
                suspect.largest,
                suspect.sum,
                suspect.ranks
            ),
            (4, 2, 4, 2)
        );
    }

    #[test]
    fn a_rank_folded_twice_counts_once() {
        let registry = registry();
        let mut columns = ColumnDictionary::default();
        let record: StepRecord = serde_json::from_value(rank(0, json!(2.0), 3.0, 0.5)).unwrap();
        let mut assigner = ColumnAssigner::new(&columns);
        let cells = flatten(&record, &registry.module_groups, &mut assigner);
        for (kind, subject, position) in assigner.added() {
            columns.restore(kind, &subject, position);
        }
        let mut pending = PendingStep::new(0.0);
        pending.fold(0, &cells, Some(5.0), &[], &columns, &registry);
        pending.fold(0, &cells, Some(9.0), &[], &columns, &registry);
        assert_eq!(pending.arrived.len(), 1);
        let combined = pending.combine(7, 2, &columns, &registry);
        assert_eq!(combined.time, Some(5.0));
        assert_eq!(combined.view.reported, 1);
        let record = unflatten(7, &combined.cells, &columns);
        assert_eq!(
            module(&record, "qwen.q").grad_norm.map(|n| n.get()),
            Some(3.0)
        );
    }

    #[test]
    fn a_rank_set_holds_ranks_past_sixty_four() {
        let mut ranks = RankSet::default();
        assert!(ranks.insert(3));
        assert!(ranks.insert(130));
        assert!(!ranks.insert(130));
        assert!(ranks.contains(130) && ranks.contains(3) && !ranks.contains(64));
        assert_eq!(ranks.len(), 2);
        assert!(!ranks.is_empty() && RankSet::default().is_empty());
    }
}
