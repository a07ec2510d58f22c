//! One step record → one row of cells, in the run's column order. This is also where
//! the server derives group norms (docs/PROTOCOL.md: "the L2 norm of the group's module
//! norms").

use rustc_hash::FxHashMap as HashMap;

use gradflow_protocol::{Float, StepRecord, default_group};

use super::codec::{ABSENT_BITS, Cell};
use super::columns::{ColumnAssigner, SeriesKind};

/// Flattens `record`; `module_groups` maps module names to their group, as the
/// registration's parameters say (modules not in it fall in their name's first part).
pub fn flatten(
    record: &StepRecord,
    module_groups: &HashMap<String, String>,
    columns: &mut ColumnAssigner<'_>,
) -> Vec<u32> {
    let mut row = Row::new(columns.column_count());
    let mut put = |columns: &mut ColumnAssigner<'_>, kind, subject: &str, cell: Cell| {
        let position = columns.position(kind, subject);
        row.set(position, cell);
    };
    let wire = |value: Option<Float>| value.map(Float::get);

    if let Some(loss) = record.loss {
        put(
            columns,
            SeriesKind::Loss,
            "",
            Cell::from_wire(Some(loss.get())),
        );
    }
    if let Some(lr) = record.lr {
        put(columns, SeriesKind::Lr, "", Cell::from_wire(Some(lr.get())));
    }
    // v1.1: each optimizer parameter group's lr, under the group's name.
    for (group, lr) in &record.lrs {
        put(
            columns,
            SeriesKind::Lr,
            group,
            Cell::from_wire(Some(lr.get())),
        );
    }
    if let Some(dropped) = record.dropped_steps {
        put(
            columns,
            SeriesKind::DroppedSteps,
            "",
            Cell::from_wire(Some(dropped as f64)),
        );
    }
    if let Some(scaler) = &record.scaler {
        if let Some(scale) = scaler.scale {
            put(
                columns,
                SeriesKind::ScalerScale,
                "",
                Cell::from_wire(Some(scale.get())),
            );
        }
        if let Some(tracker) = scaler.growth_tracker {
            put(
                columns,
                SeriesKind::ScalerGrowthTracker,
                "",
                Cell::from_wire(Some(tracker as f64)),
            );
        }
        if let Some(found_inf) = scaler.found_inf {
            put(columns, SeriesKind::FoundInf, "", flag(found_inf));
        }
        if let Some(skipped) = scaler.step_skipped {
            put(columns, SeriesKind::StepSkipped, "", flag(skipped));
        }
    }

    // Columns are handed out kind by kind (all module norms, then all hook hits, then
    // each parameter field), not module by module: the run's first step fixes the
    // order, and keeping a kind's columns together keeps the constant ones (hook hits
    // of 1, update norms of 0) contiguous, which is what lets zstd squeeze them out.
    //
    // Group norms: sqrt of the sum of squared module norms. A group none of whose
    // reported modules had a gradient is null; one with no reported module, absent.
    let mut groups: Vec<(&str, GroupNorm)> = Vec::new();
    for module in &record.modules {
        let norm = wire(module.grad_norm);
        put(
            columns,
            SeriesKind::ModuleGradNorm,
            &module.module,
            Cell::from_wire(norm),
        );
        let group = module_groups
            .get(&module.module)
            .map(String::as_str)
            .unwrap_or_else(|| default_group(&module.module));
        let entry = match groups.iter_mut().find(|(name, _)| *name == group) {
            Some((_, entry)) => entry,
            None => {
                groups.push((group, GroupNorm::default()));
                &mut groups.last_mut().expect("just pushed").1
            }
        };
        entry.add(norm);
    }
    for module in &record.modules {
        if let Some(hits) = module.hook_hits {
            put(
                columns,
                SeriesKind::HookHits,
                &module.module,
                Cell::from_wire(Some(hits as f64)),
            );
        }
    }
    for (group, norm) in &groups {
        put(columns, SeriesKind::GroupGradNorm, group, norm.cell());
    }

    type ParamField = fn(&gradflow_protocol::ParamStep) -> Option<Float>;
    let fields: [(SeriesKind, ParamField); 8] = [
        (SeriesKind::ParamGradNorm, |p| p.grad_norm),
        (SeriesKind::UpdateNorm, |p| p.update_norm),
        (SeriesKind::Drift, |p| p.drift),
        (SeriesKind::ParamMean, |p| p.mean),
        (SeriesKind::IntendedUpdateNorm, |p| p.intended_update_norm),
        (SeriesKind::IntendedUpdateMaxUlp, |p| {
            p.intended_update_max_ulp
        }),
        (SeriesKind::IntendedNonzero, |p| {
            p.intended_nonzero.map(|n| Float(n as f64))
        }),
        (SeriesKind::RoundedAway, |p| {
            p.rounded_away.map(|n| Float(n as f64))
        }),
    ];

    for (kind, field) in fields {
        for param in &record.params {
            if let Some(value) = field(param) {
                put(
                    columns,
                    kind,
                    &param.name,
                    Cell::from_wire(Some(value.get())),
                );
            }
        }
    }

    for gpu in &record.gpu {
        let subject = gpu.index.to_string();
        let bytes = |b: Option<u64>| b.map(|b| b as f64);
        for (kind, value) in [
            (SeriesKind::GpuMemoryUsedBytes, bytes(gpu.memory_used_bytes)),
            (
                SeriesKind::GpuMemoryTotalBytes,
                bytes(gpu.memory_total_bytes),
            ),
            (SeriesKind::GpuUtilizationPct, wire(gpu.utilization_pct)),
            (SeriesKind::GpuTemperatureC, wire(gpu.temperature_c)),
            (SeriesKind::GpuPowerW, wire(gpu.power_w)),
        ] {
            if let Some(value) = value {
                put(columns, kind, &subject, Cell::from_wire(Some(value)));
            }
        }
    }

    for (name, value) in &record.metrics {
        put(
            columns,
            SeriesKind::Metric,
            name,
            Cell::from_wire(wire(*value)),
        );
    }

    row.into_bits()
}

fn flag(on: bool) -> Cell {
    Cell::Value(if on { 1.0 } else { 0.0 })
}

#[derive(Default)]
struct GroupNorm {
    sum_of_squares: f64,
    any_value: bool,
}

impl GroupNorm {
    fn add(&mut self, norm: Option<f64>) {
        if let Some(norm) = norm {
            self.sum_of_squares += norm * norm;
            self.any_value = true;
        }
    }

    fn cell(&self) -> Cell {
        if self.any_value {
            Cell::from_wire(Some(self.sum_of_squares.sqrt()))
        } else {
            Cell::Null
        }
    }
}

/// A row that grows as columns are added while it is being filled.
struct Row(Vec<u32>);

impl Row {
    fn new(len: u32) -> Self {
        Row(vec![ABSENT_BITS; len as usize])
    }

    fn set(&mut self, position: u32, cell: Cell) {
        let position = position as usize;
        if position >= self.0.len() {
            self.0.resize(position + 1, ABSENT_BITS);
        }
        self.0[position] = cell.to_bits();
    }

    fn into_bits(self) -> Vec<u32> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::columns::ColumnDictionary;

    fn record(json: &str) -> StepRecord {
        gradflow_protocol::parse_steps_json(format!("[{json}]").as_bytes())
            .unwrap()
            .remove(0)
    }

    fn cell(row: &[u32], dictionary: &ColumnDictionary, kind: SeriesKind, subject: &str) -> Cell {
        let position = dictionary.get(kind, subject).expect("column exists") as usize;
        Cell::from_bits(row.get(position).copied().unwrap_or(ABSENT_BITS))
    }

    fn run(json: &str, groups: &HashMap<String, String>) -> (Vec<u32>, ColumnDictionary) {
        let base = ColumnDictionary::default();
        let mut assigner = ColumnAssigner::new(&base);
        let row = flatten(&record(json), groups, &mut assigner);
        let mut dictionary = ColumnDictionary::default();
        for (kind, subject, _) in assigner.added() {
            dictionary.push(kind, &subject);
        }
        (row, dictionary)
    }

    #[test]
    fn group_norm_is_the_l2_norm_of_module_norms() {
        let (row, dict) = run(
            r#"{"step": 1, "modules": [
                {"module": "qwen.a", "grad_norm": 3.0, "hook_hits": 1},
                {"module": "qwen.b", "grad_norm": 4.0, "hook_hits": 1},
                {"module": "agent.x", "grad_norm": null, "hook_hits": 0}]}"#,
            &HashMap::default(),
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GroupGradNorm, "qwen"),
            Cell::Value(5.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GroupGradNorm, "agent"),
            Cell::Null
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ModuleGradNorm, "agent.x"),
            Cell::Null
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::HookHits, "agent.x"),
            Cell::Value(0.0)
        );
    }

    #[test]
    fn registered_groups_override_the_name_rule() {
        let groups = HashMap::from_iter([("backbone.mlp".to_owned(), "qwen".to_owned())]);
        let (row, dict) = run(
            r#"{"step": 1, "modules": [{"module": "backbone.mlp", "grad_norm": 2.0}]}"#,
            &groups,
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GroupGradNorm, "qwen"),
            Cell::Value(2.0)
        );
        assert_eq!(dict.get(SeriesKind::GroupGradNorm, "backbone"), None);
    }

    #[test]
    fn non_finite_module_norms_poison_their_group() {
        let (row, dict) = run(
            r#"{"step": 1, "modules": [{"module": "q.a", "grad_norm": "NaN"}, {"module": "q.b", "grad_norm": 1}]}"#,
            &HashMap::default(),
        );
        assert!(
            matches!(cell(&row, &dict, SeriesKind::GroupGradNorm, "q"), Cell::Value(v) if v.is_nan())
        );
    }

    #[test]
    fn scalars_params_gpus_and_metrics_get_their_own_columns() {
        let (row, dict) = run(
            r#"{"step": 1, "loss": 2.5, "lr": 0.001,
                "scaler": {"scale": 65536, "growth_tracker": 3, "found_inf": true, "step_skipped": false},
                "params": [{"name": "w", "grad_norm": 0.1, "update_norm": 0, "drift": 0, "mean": 1}],
                "gpu": [{"index": 1, "memory_used_bytes": 1024, "utilization_pct": 50}],
                "metrics": {"reward": null, "acc": 0.5}}"#,
            &HashMap::default(),
        );
        assert_eq!(cell(&row, &dict, SeriesKind::Loss, ""), Cell::Value(2.5));
        assert_eq!(
            cell(&row, &dict, SeriesKind::FoundInf, ""),
            Cell::Value(1.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::StepSkipped, ""),
            Cell::Value(0.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ScalerGrowthTracker, ""),
            Cell::Value(3.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::ParamMean, "w"),
            Cell::Value(1.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::UpdateNorm, "w"),
            Cell::Value(0.0)
        );
        assert_eq!(
            cell(&row, &dict, SeriesKind::GpuMemoryUsedBytes, "1"),
            Cell::Value(1024.0)
        );
        assert_eq!(cell(&row, &dict, SeriesKind::Metric, "reward"), Cell::Null);
        assert_eq!(
            cell(&row, &dict, SeriesKind::Metric, "acc"),
            Cell::Value(0.5)
        );
        assert_eq!(dict.get(SeriesKind::GpuTemperatureC, "1"), None);
    }
}
