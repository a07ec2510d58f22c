//! Which modules backward reached, as PyTorch's full backward hooks would tell, and
//! what the attention layers saw, as the Python client's attention signals tell.
//!
//! Layers record their output tensor as the forward pass makes it (`record`), while
//! a trainer captures them (`capture`). After the loss is known, `Outputs::hits`
//! asks candle's graph which of those outputs `backward` visits: the nodes on a path
//! from the loss down to a variable (`Tensor::sorted_nodes`, the very walk backward
//! starts with). Backward computes a gradient for each of them and then frees it
//! (candle keeps only variables' gradients), so this is the one place the fact is
//! still known. A module reached through its input while its own parameters are
//! outside the graph counts, and a module cut off by a `detach` does not, whatever
//! its parameters received. It costs one walk of the graph on the host, no work on
//! the device.
//!
//! Attention layers record their statistics (`record_attention`) as tensors on the
//! device, which the trainer brings to the host in the step's one transfer; outside
//! a capture, or in one that leaves them out, they are not computed at all
//! (`attention_wanted`).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use candle_core::{Tensor, TensorId};

/// What one forward pass recorded.
#[derive(Debug, Default)]
struct Recorded {
    /// Whether attention layers compute and record their statistics.
    attention_wanted: bool,
    outputs: Vec<(String, TensorId)>,
    attention: Vec<(String, Tensor)>,
}

thread_local! {
    /// What was recorded so far, while a capture is under way on this thread.
    static CAPTURING: RefCell<Option<Recorded>> = const { RefCell::new(None) };
}

/// Notes that `module` produced `output` (nothing happens outside a capture).
pub fn record(module: &str, output: &Tensor) {
    CAPTURING.with_borrow_mut(|capturing| {
        if let Some(recorded) = capturing {
            recorded.outputs.push((module.to_owned(), output.id()));
        }
    });
}

/// Whether a capture that wants attention statistics is under way on this thread:
/// they cost device work, so attention layers compute them only then.
pub fn attention_wanted() -> bool {
    CAPTURING.with_borrow(|capturing| capturing.as_ref().is_some_and(|r| r.attention_wanted))
}

/// Notes attention module `module`'s statistics: an f32 tensor of two elements, its
/// largest pre-softmax logit and its smallest head entropy (nothing happens outside
/// a capture).
pub fn record_attention(module: &str, statistics: Tensor) {
    CAPTURING.with_borrow_mut(|capturing| {
        if let Some(recorded) = capturing {
            recorded.attention.push((module.to_owned(), statistics));
        }
    });
}

/// The module outputs one forward pass produced, in the order they were made, and
/// its attention layers' statistics.
#[derive(Debug, Default)]
pub struct Outputs {
    outputs: Vec<(String, TensorId)>,
    /// Per attention module call: its name and its `[max logit, min entropy]`.
    pub attention: Vec<(String, Tensor)>,
}

/// Runs `forward`, recording the module outputs it makes on this thread and, with
/// `attention`, its attention layers' statistics.
pub fn capture<T>(attention: bool, forward: impl FnOnce() -> T) -> (T, Outputs) {
    /// Ends the capture however `forward` returns, a panic included, and restores
    /// any capture it was nested in.
    struct Restore(Option<Recorded>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            CAPTURING.with_borrow_mut(|capturing| *capturing = outer);
        }
    }
    let recorded = Recorded {
        attention_wanted: attention,
        ..Recorded::default()
    };
    let outer = CAPTURING.with_borrow_mut(|capturing| capturing.replace(recorded));
    let restore = Restore(outer);
    let value = forward();
    let recorded = CAPTURING.with_borrow_mut(|capturing| capturing.take().unwrap_or_default());
    drop(restore);
    (
        value,
        Outputs {
            outputs: recorded.outputs,
            attention: recorded.attention,
        },
    )
}

impl Outputs {
    /// For each module named in `modules`, how many of its recorded outputs backward
    /// from `loss` reaches (0 where it never ran or was cut off).
    pub fn hits(&self, loss: &Tensor, modules: &[&str]) -> Vec<u32> {
        let reached: HashSet<TensorId> = loss.sorted_nodes().iter().map(|t| t.id()).collect();
        let index: HashMap<&str, usize> =
            modules.iter().enumerate().map(|(k, m)| (*m, k)).collect();
        let mut hits = vec![0u32; modules.len()];
        for (module, id) in &self.outputs {
            if reached.contains(id)
                && let Some(&k) = index.get(module.as_str())
            {
                hits[k] += 1;
            }
        }
        hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn ones(n: usize) -> Tensor {
        Tensor::ones(n, candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_module_without_parameters_in_the_graph_is_reached_through_its_input() {
        let w = Var::from_tensor(&ones(3)).unwrap();
        let frozen = ones(3); // a plain tensor, not a variable: no optimizer holds it
        let (loss, outputs) = capture(false, || {
            let below = (w.as_tensor() * 2.0).unwrap();
            record("below", &below);
            let above = (&below * &frozen).unwrap();
            record("above", &above);
            above.sum_all().unwrap()
        });
        assert_eq!(outputs.hits(&loss, &["below", "above"]), [1, 1]);
    }

    #[test]
    fn a_detached_output_is_not_reached_and_nothing_outside_a_capture_is_kept() {
        let w = Var::from_tensor(&ones(3)).unwrap();
        let v = Var::from_tensor(&ones(3)).unwrap();
        record("ignored", w.as_tensor());
        let (loss, outputs) = capture(false, || {
            let cut = (w.as_tensor() * 2.0).unwrap();
            record("cut", &cut);
            let head = (cut.detach() * v.as_tensor()).unwrap();
            record("head", &head);
            head.sum_all().unwrap()
        });
        assert_eq!(outputs.hits(&loss, &["cut", "head", "ignored"]), [0, 1, 0]);
    }

    #[test]
    fn a_module_called_twice_counts_each_call_and_an_unused_output_none() {
        let w = Var::from_tensor(&ones(2)).unwrap();
        let (loss, outputs) = capture(false, || {
            let a = (w.as_tensor() * 3.0).unwrap();
            record("shared", &a);
            let b = (&a * 3.0).unwrap();
            record("shared", &b);
            record("unused", &(w.as_tensor() * 5.0).unwrap());
            b.sum_all().unwrap()
        });
        assert_eq!(outputs.hits(&loss, &["shared", "unused"]), [2, 0]);
    }
}
