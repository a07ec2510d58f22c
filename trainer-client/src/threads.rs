//! candle's CPU backend asks for its thread count on every matrix multiply
//! (`candle_core::utils::get_num_threads`), and unless `RAYON_NUM_THREADS` is set,
//! that means opening and parsing /proc/cpuinfo (`num_cpus::get_physical`) each
//! time. At the `tiny` preset that was a third of a step's CPU time, spent in the
//! kernel formatting the file, and the instrumentation's per-gradient reductions
//! (one matrix product each) paid it once more per parameter. Setting the variable
//! once, to the count candle computes, keeps its choice and drops the reads.

/// Sets `RAYON_NUM_THREADS` to candle's own thread count, unless it already holds
/// one that candle accepts.
///
/// # Safety
///
/// It sets an environment variable: call it before any other thread is started
/// (see [`std::env::set_var`]).
pub unsafe fn settle_thread_count() {
    let set = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .is_some_and(|n| n > 0);
    if !set {
        let threads = candle_core::utils::get_num_threads();
        // SAFETY: the caller guarantees no other thread runs yet.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    }
}
