//! A batch whose request is dropped half-way (the client gone, the request timeout)
//! must leave the store exactly as if the batch had been stored whole or not at all,
//! with the server's cached view of the run agreeing with the database. Here the
//! ingest future itself is dropped after each number of polls in turn, so the drop
//! lands at every await point of the batch transaction, COMMIT included.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Waker};
use std::time::Duration;

use gradflow_core::detect::Detection;
use gradflow_protocol::{RunId, RunRegistration, StepRecord, parse_steps_json};
use serde_json::{Value, json};

fn batch(from: u64, to: u64) -> Vec<StepRecord> {
    let modules: Vec<Value> = (0..64)
        .map(|m| json!({"module": format!("agent.block{m}"), "grad_norm": 0.5, "hook_hits": 1}))
        .collect();
    let records: Vec<Value> = (from..to)
        .map(|s| json!({"step": s, "loss": 1.0, "modules": modules}))
        .collect();
    parse_steps_json(serde_json::to_vec(&records).unwrap().as_slice()).unwrap()
}

/// Polls `future` up to `polls` times, letting the database's worker thread run
/// between polls, then drops it. True when it finished before that.
async fn poll_then_drop(future: impl Future, polls: usize) -> bool {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..polls {
        if future.as_mut().poll(&mut cx).is_ready() {
            return true;
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_batch_at_any_await_point_leaves_the_run_consistent() {
    let test = crate::common::TestStore::open(Detection::default()).await;
    let (store, ingest) = (&test.store, &test.ingest);
    let run = RunId::parse("r").unwrap();
    let registration: RunRegistration = serde_json::from_value(json!({"params": []})).unwrap();
    ingest.register_run(&run, registration).await.unwrap();

    let mut next = 0u64;
    let mut finished_early = 0;
    for polls in 1..60 {
        let first = batch(next, next + 20);
        if poll_then_drop(ingest.ingest(&run, &first), polls).await {
            finished_early += 1;
        }
        // The same steps again and one more: the store must know exactly what the
        // dropped attempt left behind.
        let again = batch(next, next + 21);
        let outcome = ingest
            .ingest(&run, &again)
            .await
            .unwrap_or_else(|e| panic!("after a drop at poll {polls}: {e}"));
        assert!(
            outcome.duplicates == 0 || outcome.duplicates == 20,
            "a batch is stored whole or not at all: {outcome:?}"
        );
        assert_eq!(outcome.accepted + outcome.duplicates, 21);
        next += 21;
        assert_eq!(outcome.last_step, Some(next - 1));
        let stored = store.run(&run).await.unwrap();
        assert_eq!(stored.step_count, next, "after a drop at poll {polls}");
    }
    assert!(
        finished_early < 59,
        "every attempt finished before its drop: the drops tested nothing"
    );
    store.close().await.unwrap();
}
