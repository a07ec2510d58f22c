//! The benchmark harness behind `gradflow-bench`: each measurement of BENCHMARKS.md
//! as a function that starts what it needs (a release `gradflow-server` on a fresh
//! temporary database, SQLite or PostgreSQL, the trainer binary, bare SQLite) and
//! returns its figures, and the report that sets them against the targets.

pub mod alarms;
pub mod backend;
pub mod baseline;
pub mod ingest;
pub mod latency;
pub mod long_run;
pub mod plot;
pub mod queries;
pub mod ranks;
pub mod report;
pub mod reporting;
pub mod scaling;

use serde::Serialize;

/// What ran the benchmarks, from Linux `/proc`.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
}

impl Machine {
    pub fn this() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split(':').nth(1))
            })
            .map_or_else(|| "unknown".to_owned(), |s| s.trim().to_owned());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib: (kib / (1 << 20) as f64 * 10.0).round() / 10.0,
        }
    }
}
