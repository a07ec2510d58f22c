//! A registration in force (as first sent, with every amendment up to some step
//! applied) and the lookups derived from it once, so that each record of a batch
//! is checked, flattened and combined without walking the registration again.

use std::sync::Arc;

use crate::detect::context::RunContext;
use crate::detect::thresholds::Thresholds;
use gradflow_protocol::{Amendment, RunRegistration};
use rustc_hash::{FxHashMap, FxHashSet};

/// A registration in force (as first sent, with every amendment up to some step
/// applied) and the lookups derived from it.
#[derive(Debug)]
pub struct Registry {
    pub registration: RunRegistration,
    /// Parameter names: a step may only report these.
    pub params: FxHashSet<String>,
    /// Module → group, from the parameters.
    pub module_groups: FxHashMap<String, String>,
    /// What the detectors know of the run.
    pub context: Arc<RunContext>,
    /// v1.4: parameters laid out `sharded`, and the modules that own one.
    pub sharded_params: FxHashSet<String>,
    pub sharded_modules: FxHashSet<String>,
    /// v1.4: each module's elements as registered (the sum of its parameters'
    /// shapes), where every one of its parameters has a shape.
    pub module_numel: FxHashMap<String, u64>,
}

impl Registry {
    pub fn new(registration: RunRegistration, thresholds: Thresholds) -> Registry {
        let mut module_numel: FxHashMap<String, Option<u64>> = FxHashMap::default();
        for param in &registration.params {
            let total = module_numel
                .entry(param.module_name().to_owned())
                .or_insert(Some(0));
            *total = total.zip(param.numel()).map(|(a, b)| a.saturating_add(b));
        }
        let sharded: Vec<&gradflow_protocol::ParamSpec> = registration
            .params
            .iter()
            .filter(|p| p.layout() == gradflow_protocol::Layout::Sharded)
            .collect();
        Registry {
            sharded_params: sharded.iter().map(|p| p.name.clone()).collect(),
            sharded_modules: sharded.iter().map(|p| p.module_name().to_owned()).collect(),
            module_numel: module_numel
                .into_iter()
                .filter_map(|(module, numel)| Some((module, numel?)))
                .collect(),
            params: registration.params.iter().map(|p| p.name.clone()).collect(),
            module_groups: registration
                .params
                .iter()
                .map(|p| (p.module_name().to_owned(), p.group_name().to_owned()))
                .collect(),
            context: Arc::new(RunContext::new(&registration, thresholds)),
            registration,
        }
    }

    /// This registration with `amendment` applied (the protocol's defaults written
    /// out, as for a registration).
    pub fn amended(&self, amendment: &Amendment, thresholds: Thresholds) -> Registry {
        let mut registration = self.registration.clone();
        registration.amend(amendment);
        Registry::new(registration.normalized(), thresholds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(value: serde_json::Value) -> RunRegistration {
        let registration: RunRegistration = serde_json::from_value(value).unwrap();
        registration.normalized()
    }

    #[test]
    fn the_lookups_follow_the_registration_and_its_amendments() {
        let registry = Registry::new(
            registration(serde_json::json!({"world_size": 2, "params": [
                {"name": "qwen.q.weight", "shape": [4, 4], "layout": "sharded", "shard_ranks": [0, 1]},
                {"name": "qwen.q.bias", "shape": [4]},
                {"name": "agent.head.weight"}
            ]})),
            Thresholds::default(),
        );
        assert!(registry.params.contains("qwen.q.bias"));
        assert_eq!(registry.module_groups["qwen.q"], "qwen");
        assert!(registry.sharded_params.contains("qwen.q.weight"));
        assert!(registry.sharded_modules.contains("qwen.q"));
        assert!(!registry.sharded_modules.contains("agent.head"));
        // Elements only where every parameter of the module has a shape.
        assert_eq!(registry.module_numel.get("qwen.q"), Some(&20));
        assert_eq!(registry.module_numel.get("agent.head"), None);
        let amendment: Amendment = serde_json::from_value(serde_json::json!({
            "params": [{"name": "agent.extra.weight", "shape": [2]}]
        }))
        .unwrap();
        let amended = registry.amended(&amendment, Thresholds::default());
        assert!(amended.params.contains("agent.extra.weight"));
        assert_eq!(amended.module_numel.get("agent.extra"), Some(&2));
        assert!(!registry.params.contains("agent.extra.weight"));
    }
}
