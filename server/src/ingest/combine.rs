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
use gradflow_core::columnar::columns::ColumnDictionary;
use gradflow_core::detect::ranks::{Divergence, RankView, ShardSuspect};
use gradflow_core::model::cell::{ABSENT_BITS, Cell, to_stored_f32};
use gradflow_core::model::series_kind::SeriesKind;

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
    /// Not combined: derived from the combined record (group norms).
    Derived,
}

fn rule(kind: SeriesKind, sharded: bool) -> Rule {
    use SeriesKind::*;
    match kind {
        Loss | Metric => Rule::Mean,
        Lr | ScalerScale | ScalerGrowthTracker => Rule::Lowest,
        FoundInf | StepSkipped | GradsCarriedOver | LocalGradsNonfinite | InputAbsmax
        | StepTime | GpuMemoryUsedBytes | GpuMemoryTotalBytes | GpuUtilizationPct
        | GpuTemperatureC | GpuPowerW => Rule::Max,
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
    }
}

/// Whether the subject of a column of `kind` is laid out sharded.
fn sharded(kind: SeriesKind, subject: &str, registry: &Registry) -> bool {
    use SeriesKind::*;
    match kind {
        ModuleGradNorm | HookHits | ModuleNumel | ModuleNonfinite | ModuleParamSum => {
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
        SeriesKind::ModuleParamSum => Some(gradflow_core::detect::ranks::WEIGHTS_SERIES),
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
                Rule::WeightedMean => {
                    let weight = columns
                        .get(SeriesKind::ParamNumel, subject)
                        .and_then(|p| cells.get(p as usize))
                        .and_then(|b| match Cell::from_bits(*b) {
                            Cell::Value(w) if w > 0.0 => Some(f64::from(w)),
                            _ => None,
                        })
                        .unwrap_or(1.0);
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
                        <= gradflow_core::detect::ranks::SHARD_SUM_TOLERANCE * registered as f64
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
                fingerprinted,
            },
        }
    }
}

/// The waiting steps of a multi-rank run.
pub type Pending = BTreeMap<u64, PendingStep>;
