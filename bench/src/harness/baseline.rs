//! The baseline a user could write in an afternoon: bare SQLite, one row per value
//! (run, step, column, value), one prepared statement, everything in one
//! transaction, with the server's journal settings (WAL, `synchronous=FULL`). It
//! stores exactly the numbers the HTTP clients send (the same seeded generators)
//! but parses no JSON and speaks no HTTP, so it is a generous baseline.

use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use crate::server::bytes_on_disk;
use crate::workload::{Generator, Shape, Step};

#[derive(Debug, Clone, Serialize)]
pub struct BaselineResult {
    pub rows: u64,
    pub seconds: f64,
    pub rows_per_second: f64,
    /// Module gradient norms stored per second (they are 230 of the 690 rows a step).
    pub module_values_per_second: f64,
    pub bytes_on_disk: u64,
    pub bytes_per_module_value: f64,
}

pub fn bare_sqlite(
    runs: usize,
    steps_per_run: u64,
    shape: Shape,
) -> anyhow::Result<BaselineResult> {
    // The same numbers as the HTTP clients', generated before the clock starts.
    let data: Vec<Vec<Step>> = (0..runs)
        .map(|r| Generator::new(shape, r as u64).steps(0, steps_per_run))
        .collect();
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let path = dir.path().join("baseline.db");
    let mut db = rusqlite::Connection::open(&path)?;
    db.pragma_update(None, "journal_mode", "WAL")?;
    db.pragma_update(None, "synchronous", "FULL")?;
    db.execute_batch("CREATE TABLE value (run INTEGER, step INTEGER, col INTEGER, value REAL)")?;

    let started = Instant::now();
    let transaction = db.transaction()?;
    let mut rows = 0u64;
    {
        let mut insert = transaction
            .prepare("INSERT INTO value (run, step, col, value) VALUES (?1, ?2, ?3, ?4)")?;
        for (run, steps) in data.iter().enumerate() {
            for s in steps {
                let mut col = 0i64;
                let mut put = |value: f32| -> rusqlite::Result<()> {
                    insert.execute((run as i64, s.step as i64, col, value as f64))?;
                    col += 1;
                    rows += 1;
                    Ok(())
                };
                put(s.loss)?;
                put(s.lr)?;
                for norm in &s.module_grad_norms {
                    put(*norm)?;
                    put(1.0)?; // hook hits
                }
                for param in &s.params {
                    for value in param {
                        put(*value)?;
                    }
                }
            }
        }
    }
    transaction.commit()?;
    let seconds = started.elapsed().as_secs_f64();
    db.close().map_err(|(_, e)| e)?;

    let module_values = runs as u64 * steps_per_run * shape.modules as u64;
    let bytes = bytes_on_disk(&path);
    Ok(BaselineResult {
        rows,
        seconds,
        rows_per_second: rows as f64 / seconds,
        module_values_per_second: module_values as f64 / seconds,
        bytes_on_disk: bytes,
        bytes_per_module_value: bytes as f64 / module_values as f64,
    })
}
