//! End-to-end tests of the real binaries (the server, the trainer, the demo), one
//! test binary with a module per scenario.

// A test may be one long table of cases: the 150-line limit is production code's.
#![allow(clippy::too_many_lines)]

mod compose;
mod crash;
mod crash_loop;
mod dashboard;
mod demo;
mod exposure;
mod failover;
mod false_alarms;
mod outage;
mod replicas;
mod salvage;
mod storage_faults;
mod trainer;
