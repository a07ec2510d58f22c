//! End-to-end tests of the real binaries (the server, the trainer, the demo), one
//! test binary with a module per scenario.

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
