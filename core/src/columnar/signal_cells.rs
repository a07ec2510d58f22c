//! The v1.8 instability signals of a step record as cells, and back: per-module
//! attention, activation and Adam statistics, each MoE layer's tokens per expert (with
//! what the server derives from them) and each micro-batch's loss.
//!
//! [`flatten`](super::flatten) writes what [`signal_cells`] yields and
//! [`unflatten`](super::flatten::unflatten) hands back what [`SignalRecord`] rebuilds.

use gradflow_protocol::{AdamState, BatchInfo, Float, ModuleStep, MoeLayer, StepRecord};

use crate::model::cell::Cell;
use crate::model::series_kind::SeriesKind;

/// A per-module v1.8 field: its series kind and how to read it from a module.
type ModuleField = (SeriesKind, fn(&ModuleStep) -> Option<f64>);

/// The per-module fields, kind by kind (a kind's columns stay together).
const MODULE_FIELDS: [ModuleField; 8] = [
    (SeriesKind::AttnMaxLogit, |m| wire(m.attn_max_logit)),
    (SeriesKind::AttnMinEntropy, |m| wire(m.attn_min_entropy)),
    (SeriesKind::ActRms, |m| wire(m.act_rms)),
    (SeriesKind::ActAbsmax, |m| wire(m.act_absmax)),
    (SeriesKind::AdamUpdated, |m| {
        m.adam.as_ref()?.updated.map(|n| n as f64)
    }),
    (SeriesKind::AdamBelowEps, |m| {
        wire(m.adam.as_ref()?.below_eps)
    }),
    (SeriesKind::AdamUpdateRms, |m| {
        wire(m.adam.as_ref()?.update_rms)
    }),
    (SeriesKind::AdamUpdateAbsmax, |m| {
        wire(m.adam.as_ref()?.update_absmax)
    }),
];

fn wire(value: Option<Float>) -> Option<f64> {
    value.map(Float::get)
}

/// The subject of an expert's token count: `layer/expert`.
pub fn expert_subject(layer: &str, expert: usize) -> String {
    format!("{layer}/{expert}")
}

/// An expert's subject split into its layer and index.
pub fn parse_expert_subject(subject: &str) -> Option<(&str, usize)> {
    let (layer, expert) = subject.rsplit_once('/')?;
    Some((layer, expert.parse().ok()?))
}

/// What the server derives from one layer's loads: the busiest expert's share of
/// the tokens, MaxVio ((max − mean) / mean) and how many experts got none. `None`
/// for a layer that routed no token.
pub fn load_summary(tokens: &[u64]) -> Option<LoadSummary> {
    let total: u64 = tokens.iter().sum();
    let max = *tokens.iter().max()?;
    if total == 0 {
        return None;
    }
    let mean = total as f64 / tokens.len() as f64;
    Some(LoadSummary {
        top_share: max as f64 / total as f64,
        max_vio: (max as f64 - mean) / mean,
        idle: tokens.iter().filter(|&&t| t == 0).count(),
        busiest: tokens.iter().position(|&t| t == max).unwrap_or(0),
    })
}

/// One MoE layer's load on one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSummary {
    pub top_share: f64,
    pub max_vio: f64,
    pub idle: usize,
    /// The expert with the most tokens (the first of them).
    pub busiest: usize,
}

/// Every v1.8 value of `record` but the scalars (the output logits, which the
/// record's own numbers carry), as `(kind, subject, cell)` in column order.
pub fn signal_cells(record: &StepRecord, put: &mut impl FnMut(SeriesKind, &str, Cell)) {
    for (kind, field) in MODULE_FIELDS {
        for module in &record.modules {
            if let Some(value) = field(module) {
                put(kind, &module.module, Cell::from_wire(Some(value)));
            }
        }
    }
    for layer in &record.moe {
        for (expert, &tokens) in layer.tokens_per_expert.iter().enumerate() {
            let subject = expert_subject(&layer.module, expert);
            put(
                SeriesKind::MoeExpertTokens,
                &subject,
                Cell::from_wire(Some(tokens as f64)),
            );
        }
    }
    for layer in &record.moe {
        if let Some(z) = wire(layer.router_z) {
            put(
                SeriesKind::MoeRouterZ,
                &layer.module,
                Cell::from_wire(Some(z)),
            );
        }
        if let Some(load) = load_summary(&layer.tokens_per_expert) {
            for (kind, value) in [
                (SeriesKind::MoeTopShare, load.top_share),
                (SeriesKind::MoeMaxVio, load.max_vio),
                (SeriesKind::MoeIdleExperts, load.idle as f64),
            ] {
                put(kind, &layer.module, Cell::from_wire(Some(value)));
            }
        }
    }
    if let Some(batch) = &record.batch {
        for (i, loss) in batch.micro_losses.iter().enumerate() {
            put(
                SeriesKind::MicroLoss,
                &i.to_string(),
                Cell::from_wire(Some(loss.get())),
            );
        }
    }
}

/// Whether a column of `kind` is derived from others (and so not read back into a
/// record).
pub fn is_derived(kind: SeriesKind) -> bool {
    matches!(
        kind,
        SeriesKind::MoeTopShare | SeriesKind::MoeMaxVio | SeriesKind::MoeIdleExperts
    )
}

/// One per-module v1.8 column's value, into the module's record; `false` when `kind`
/// is not one.
pub fn set_module_signal(module: &mut ModuleStep, kind: SeriesKind, value: Option<f64>) -> bool {
    let float = value.map(Float);
    fn adam(module: &mut ModuleStep) -> &mut AdamState {
        module.adam.get_or_insert_with(AdamState::default)
    }
    match kind {
        SeriesKind::AttnMaxLogit => module.attn_max_logit = float,
        SeriesKind::AttnMinEntropy => module.attn_min_entropy = float,
        SeriesKind::ActRms => module.act_rms = float,
        SeriesKind::ActAbsmax => module.act_absmax = float,
        SeriesKind::AdamUpdated => adam(module).updated = value.map(|v| v as u64),
        SeriesKind::AdamBelowEps => adam(module).below_eps = float,
        SeriesKind::AdamUpdateRms => adam(module).update_rms = float,
        SeriesKind::AdamUpdateAbsmax => adam(module).update_absmax = float,
        _ => return false,
    }
    true
}

/// The record-level v1.8 values being read back from a row: the MoE layers (in the
/// order their columns come) and the micro-batch losses.
#[derive(Default)]
pub struct SignalRecord {
    moe: Vec<MoeLayer>,
    micro_losses: Vec<Float>,
}

impl SignalRecord {
    /// Takes one column's value; `false` when `kind` is not a record-level v1.8 one.
    pub fn take(&mut self, kind: SeriesKind, subject: &str, value: Option<f64>) -> bool {
        match kind {
            SeriesKind::MoeExpertTokens => {
                if let (Some((layer, expert)), Some(tokens)) =
                    (parse_expert_subject(subject), value)
                {
                    let layer = self.layer(layer);
                    if layer.tokens_per_expert.len() <= expert {
                        layer.tokens_per_expert.resize(expert + 1, 0);
                    }
                    layer.tokens_per_expert[expert] = tokens as u64;
                }
            }
            SeriesKind::MoeRouterZ => self.layer(subject).router_z = value.map(Float),
            SeriesKind::MicroLoss => {
                if let Ok(i) = subject.parse::<usize>() {
                    if self.micro_losses.len() <= i {
                        self.micro_losses.resize(i + 1, Float(f64::NAN));
                    }
                    self.micro_losses[i] = Float(value.unwrap_or(f64::NAN));
                }
            }
            _ => return is_derived(kind),
        }
        true
    }

    fn layer(&mut self, module: &str) -> &mut MoeLayer {
        let index = match self.moe.iter().position(|l| l.module == module) {
            Some(index) => index,
            None => {
                self.moe.push(MoeLayer {
                    module: module.to_owned(),
                    ..MoeLayer::default()
                });
                self.moe.len() - 1
            }
        };
        &mut self.moe[index]
    }

    /// Writes what was read into `record`.
    pub fn finish(self, record: &mut StepRecord) {
        record.moe = self.moe;
        if !self.micro_losses.is_empty() {
            record
                .batch
                .get_or_insert_with(BatchInfo::default)
                .micro_losses = self.micro_losses;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_s_load_says_its_busiest_expert_its_imbalance_and_its_idle_experts() {
        let load = load_summary(&[0, 0, 6, 2]).unwrap();
        assert_eq!(load.top_share, 0.75);
        assert_eq!(load.max_vio, 2.0);
        assert_eq!((load.idle, load.busiest), (2, 2));
        // Balanced: MaxVio 0.
        assert_eq!(load_summary(&[3, 3, 3]).unwrap().max_vio, 0.0);
        // Nothing routed: nothing to say.
        assert_eq!(load_summary(&[0, 0]), None);
        assert_eq!(load_summary(&[]), None);
    }

    #[test]
    fn an_expert_subject_reads_back_its_layer_and_index() {
        let subject = expert_subject("model.layers.3/mlp.gate", 17);
        assert_eq!(
            parse_expert_subject(&subject),
            Some(("model.layers.3/mlp.gate", 17))
        );
        assert_eq!(parse_expert_subject("layer"), None);
        assert_eq!(parse_expert_subject("layer/x"), None);
    }
}
