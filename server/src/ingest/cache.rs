//! The runs' ingest states a server keeps, bounded: the least recently used run's
//! is dropped past [`RunCache::capacity`] (it is read back from the database at its
//! next batch), so a server that has seen thousands of runs holds only the busy
//! ones.
//!
//! Each run has a slot behind an async mutex: a batch holds its run's slot from
//! preparing to committing, so two batches of one run on one server take turns
//! (batches of different runs do not wait for each other), and a state is never
//! seen half-updated. The slot's state is `None` until loaded, and is emptied when
//! a batch fails part-way, so the next one reloads it.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use lru::LruCache;

use super::state::RunState;

/// A run's slot.
pub type Slot = Arc<tokio::sync::Mutex<Option<RunState>>>;

pub struct RunCache {
    slots: Mutex<LruCache<String, Slot>>,
}

impl RunCache {
    /// A cache of `capacity` runs. A run of the 1.5B shape holds ~100 KB (its column
    /// dictionary, detector state and two growing rollup buckets): 256 runs, the
    /// server's default, are ~25 MB.
    pub fn new(capacity: usize) -> RunCache {
        RunCache {
            slots: Mutex::new(LruCache::new(
                NonZeroUsize::new(capacity.max(1)).expect("at least one"),
            )),
        }
    }

    /// The slot of `run_id`, created empty if the run has none.
    pub fn slot(&self, run_id: &str) -> Slot {
        let mut slots = self.slots.lock().expect("not poisoned");
        if let Some(slot) = slots.get(run_id) {
            return slot.clone();
        }
        let slot = Slot::default();
        slots.put(run_id.to_owned(), slot.clone());
        slot
    }

    /// How many runs have a slot.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().expect("not poisoned").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_run_goes_first() {
        let cache = RunCache::new(2);
        let a = cache.slot("a");
        let b = cache.slot("b");
        assert!(
            Arc::ptr_eq(&a, &cache.slot("a")),
            "a slot is kept while used"
        );
        cache.slot("c");
        assert_eq!(cache.len(), 2);
        assert!(Arc::ptr_eq(&a, &cache.slot("a")), "a was used last: b went");
        assert!(
            !Arc::ptr_eq(&b, &cache.slot("b")),
            "b comes back as a new slot"
        );
    }
}
