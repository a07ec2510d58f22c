//! The benchmark tools at smoke sizes, one test binary: the harness's every part
//! (`harness`) and the load generator's short form (`load`).

mod harness;
mod load;
