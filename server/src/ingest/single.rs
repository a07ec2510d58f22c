//! Preparing a batch of a run of one process: its new records flattened into the
//! run's stream (blocks, rollup buckets) and judged by the detectors, in step
//! order, each against the registration in force at it.

use std::sync::Arc;

use anyhow::Context;
use gradflow_protocol::StepRecord;

use super::error::IngestResult;
use super::plan::{
    Batch, Codec, IngestOutcome, Preparation, Prepared, Refused, StepCells, check_amendment,
    check_params, detect, new_columns, steps_measured, write_stream,
};
use super::state::RunState;
use crate::store::{BatchWrite, Progress, RUN_STREAM};
use gradflow_core::columnar::codec::ABSENT_BITS;
use gradflow_core::columnar::columns::ColumnAssigner;
use gradflow_core::columnar::flatten::flatten;
use gradflow_core::detect::Thresholds;
use gradflow_core::run::registry::Registry;

/// Prepares `batch` for the run of `state` (see [`super::plan`]). The records up to
/// the run's last stored step are not new; a batch of nothing else is
/// [`Preparation::NothingNew`]. A record the run refuses leaves the state untouched.
pub fn prepare_single(
    state: RunState,
    batch: &Batch<'_>,
    codec: &mut Codec,
) -> Result<Preparation, Refused> {
    let (run_id, records, detection) = (batch.run_id, batch.records, batch.detection);
    let last_stored = state.last_step;
    // Steps strictly increase within a batch, so the duplicates are a prefix.
    let first_new = records
        .iter()
        .position(|r| last_stored.is_none_or(|last| r.step > last))
        .unwrap_or(records.len());
    let (duplicates, new) = records.split_at(first_new);
    if new.is_empty() {
        let outcome = IngestOutcome {
            accepted: 0,
            duplicates: duplicates.len(),
            late: 0,
            last_step: last_stored,
            values: 0,
        };
        return Ok(Preparation::NothingNew(outcome, Box::new(state)));
    }
    // The registration in force at each new record: v1.1 amendments take effect at
    // the record that carries them. A duplicate's amendment was applied when it was
    // first stored.
    let registries = match registries_in_force(&state, new, first_new, detection.thresholds) {
        Ok(registries) => registries,
        Err(error) => return Err(Refused::untouched(error, state)),
    };

    let mut assigner = ColumnAssigner::new(&state.columns);
    let rows: Vec<StepCells> = new
        .iter()
        .zip(&registries)
        .map(|(record, registry)| StepCells {
            step: record.step,
            time: record.time.map(|t| t.unix_seconds()),
            cells: flatten(record, &registry.module_groups, &mut assigner),
        })
        .collect();
    let added = assigner.added();

    let before = state.registry.clone();
    let (key, version) = (state.head.key, state.head.version);
    let mut next = state;
    for (kind, subject, position) in &added {
        next.columns.restore(*kind, subject, *position);
    }
    let mut blocks = Vec::new();
    let mut rollups = Vec::new();
    let tail = write_stream(
        next.streams.get(&RUN_STREAM),
        RUN_STREAM,
        &rows,
        next.columns.kinds(),
        &mut blocks,
        &mut rollups,
        codec,
    )?;
    next.streams.insert(RUN_STREAM, tail);

    let alerts = detect(
        detection.enabled,
        &mut next.detectors,
        &before,
        new.iter().zip(&registries).map(|(r, g)| (r, g, None)),
    );
    let last = new.last().expect("at least one new record").step;
    next.last_step = Some(last);
    next.head.version += 1;
    next.registry = registries.last().expect("at least one new record").clone();

    let amendments = new
        .iter()
        .filter_map(|r| r.amend.as_ref().map(|a| (r.step, a)))
        .map(|(step, amendment)| {
            Ok((
                step,
                serde_json::to_string(amendment).context("encoding an amendment")?,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let outcome = IngestOutcome {
        accepted: new.len(),
        duplicates: duplicates.len(),
        late: 0,
        last_step: Some(last),
        values: rows
            .iter()
            .map(|row| row.cells.iter().filter(|c| **c != ABSENT_BITS).count())
            .sum(),
    };
    let write = BatchWrite {
        run_id: run_id.to_owned(),
        key,
        expected_version: version,
        progress: Progress {
            first_step: Some(new[0].step),
            last_step: Some(last),
            steps: steps_measured(&rows),
        },
        amendments,
        columns: new_columns(added),
        blocks,
        rollups,
        alerts,
        detector_state: serde_json::to_string(&next.detectors)
            .context("encoding detector state")?,
        pending_since: None,
    };
    Ok(Preparation::Write(Box::new(Prepared {
        write,
        next,
        outcome,
    })))
}

/// The registration in force at each of `new` (which starts at batch index
/// `offset`), checking that the parameters each record reports are registered by
/// then and that what an amendment says holds together. Shares the registry between
/// records until an amendment changes it.
fn registries_in_force(
    state: &RunState,
    new: &[StepRecord],
    offset: usize,
    thresholds: Thresholds,
) -> IngestResult<Vec<Arc<Registry>>> {
    let mut current = state.registry.clone();
    let mut registries = Vec::with_capacity(new.len());
    for (k, record) in new.iter().enumerate() {
        let i = offset + k;
        if let Some(amendment) = &record.amend {
            let amended = current.amended(amendment, thresholds);
            check_amendment(&amended, amendment, i)?;
            current = Arc::new(amended);
        }
        check_params(&current, record, i)?;
        registries.push(current.clone());
    }
    Ok(registries)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::ingest::testing::{prepare_at, records, registered, written};
    use crate::store::AlertOp;
    use gradflow_core::model::alert::AlertKind;

    fn run() -> RunState {
        registered(json!({"params": [{"name": "qwen.a.weight"}, {"name": "agent.b.weight"}]}))
    }

    fn steps(steps: std::ops::Range<u64>, loss: impl Fn(u64) -> Value) -> Vec<StepRecord> {
        records(steps.map(|s| {
            json!({"step": s, "loss": loss(s), "modules": [
                {"module": "qwen.a", "grad_norm": 0.5, "hook_hits": 1},
                {"module": "agent.b", "grad_norm": 0.25, "hook_hits": 1}]})
        }))
    }

    #[test]
    fn new_steps_are_written_and_sent_again_are_nothing_new() {
        let batch = steps(0..3, |_| json!(2.0));
        let prepared = written(run(), &batch);
        let write = &prepared.write;
        assert_eq!(
            (
                write.progress.first_step,
                write.progress.last_step,
                write.progress.steps
            ),
            (Some(0), Some(2), 3)
        );
        assert_eq!((write.key, write.expected_version), (1, 0));
        // One block of the run's stream, its rollup buckets, the columns it named.
        assert_eq!(write.blocks.len(), 1);
        assert_eq!(
            (write.blocks[0].stream, write.blocks[0].mask),
            (RUN_STREAM, 0b111)
        );
        assert!(!write.rollups.is_empty());
        assert!(write.columns.iter().any(|c| c.subject == "qwen.a"));
        assert_eq!(prepared.outcome.accepted, 3);
        assert_eq!(prepared.next.last_step, Some(2));
        assert_eq!(prepared.next.head.version, 1);
        // The same records again: nothing new, the state given back as it was.
        match prepare_at(prepared.next, &batch, 0.0, None) {
            Ok(Preparation::NothingNew(outcome, state)) => {
                assert_eq!((outcome.accepted, outcome.duplicates), (0, 3));
                assert_eq!(state.last_step, Some(2));
            }
            _ => panic!("a resent batch is nothing new"),
        }
    }

    #[test]
    fn a_record_with_only_an_amendment_is_stored_but_not_counted_as_a_step() {
        let mut batch = steps(0..3, |_| json!(2.0));
        batch.extend(records([json!({"step": 3, "time": 1_795_000_000.0,
            "amend": {"params": [{"name": "agent.b.weight", "requires_grad": false}]}})]));
        let prepared = written(run(), &batch);
        let write = &prepared.write;
        assert_eq!(
            (write.progress.last_step, write.progress.steps),
            (Some(3), 3)
        );
        assert_eq!(prepared.outcome.accepted, 4);
        assert_eq!(write.amendments.len(), 1);
        assert_eq!(write.amendments[0].0, 3);
        assert_eq!(prepared.next.last_step, Some(3));
    }

    #[test]
    fn a_record_the_run_refuses_leaves_the_state_untouched() {
        let mut batch = steps(0..2, |_| json!(2.0));
        batch[1].params = records([json!({"step": 1, "params": [{"name": "nope.weight"}]})])
            .remove(0)
            .params;
        let Err(refused) = prepare_at(run(), &batch, 0.0, None) else {
            panic!("an unregistered parameter is refused");
        };
        assert!(
            refused.error.to_string().contains("nope.weight"),
            "{}",
            refused.error
        );
        let state = refused.state.expect("the state comes back");
        assert_eq!((state.last_step, state.head.version), (None, 0));
    }

    #[test]
    fn the_detectors_transitions_become_store_operations() {
        // A NaN loss on step 2; finite again from step 3, for the kind's hold.
        let batch = steps(0..30, |s| if s == 2 { json!("NaN") } else { json!(2.0) });
        let prepared = written(run(), &batch);
        let ops: Vec<String> = prepared
            .write
            .alerts
            .iter()
            .map(|op| match op {
                AlertOp::Open(opened) => format!("open {} {:?}", opened.kind, opened.step),
                AlertOp::Resolve {
                    kind,
                    subject,
                    step,
                    last_step,
                } => format!("resolve {kind} {subject} {step} {last_step:?}"),
                AlertOp::Extend { kind, .. } => format!("extend {kind}"),
            })
            .collect();
        assert_eq!(
            ops,
            [
                "open loss_nonfinite Some(2)",
                "resolve loss_nonfinite loss 3 Some(2)"
            ]
        );
        // Nothing is left open, so nothing is extended.
        assert!(prepared.next.detectors.episodes.is_empty());
        let stored: Value = serde_json::from_str(&prepared.write.detector_state).unwrap();
        assert_eq!(stored["episodes"], json!({"open": {}}));
        let open = written(
            run(),
            &steps(0..3, |s| if s == 2 { json!("NaN") } else { json!(2.0) }),
        );
        assert!(matches!(
            open.write.alerts.last(),
            Some(AlertOp::Extend {
                kind: AlertKind::LossNonfinite,
                last_step: Some(2),
                ..
            })
        ));
    }
}
