//! What the ingest service's unit tests share: a run's state as registration makes
//! it, and batches prepared against it, all in memory.

#![cfg(test)]

use gradflow_protocol::{RunRegistration, StepRecord};
use serde_json::Value;

use super::plan::{Batch, Clock, Preparation, Prepared, Refused, with_codec};
use super::state::RunState;
use gradflow_core::detect::{Detection, Thresholds};

/// A run just registered (key 1) from its registration's JSON.
pub fn registered(registration: Value) -> RunState {
    let registration: RunRegistration = serde_json::from_value(registration).unwrap();
    RunState::new(1, &registration.normalized(), Thresholds::default())
}

/// Step records from their JSON.
pub fn records(values: impl IntoIterator<Item = Value>) -> Vec<StepRecord> {
    values
        .into_iter()
        .map(|value| serde_json::from_value(value).unwrap())
        .collect()
}

/// `records` prepared against `state` at server time `now` (`closing`: a rank
/// that says it closed).
pub fn prepare_at(
    state: RunState,
    records: &[StepRecord],
    now: f64,
    closing: Option<u32>,
) -> Result<Preparation, Refused> {
    let batch = Batch {
        run_id: "r",
        records,
        detection: Detection::default(),
        clock: Clock {
            now,
            rank_timeout: 60.0,
        },
        closing,
    };
    with_codec(|codec| super::prepare(state, &batch, codec))
}

/// [`prepare_at`] that must write.
pub fn written(state: RunState, records: &[StepRecord]) -> Prepared {
    match prepare_at(state, records, 0.0, None) {
        Ok(Preparation::Write(prepared)) => *prepared,
        Ok(Preparation::NothingNew(outcome, _)) => panic!("nothing new: {outcome:?}"),
        Err(refused) => panic!("refused: {}", refused.error),
    }
}
