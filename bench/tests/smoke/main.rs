//! The benchmark tools at smoke sizes, one test binary: the harness's every part
//! (`harness`) and the load generator's short form (`load`).

// A test may be one long table of cases: the 150-line limit is production code's.
#![allow(clippy::too_many_lines)]

mod harness;
mod load;
