//! A registration in force (as first sent, with every amendment up to some step
//! applied) and the lookups ingest derives from it once, so that each record of a
//! batch is checked and flattened without walking the registration again.

use std::sync::Arc;

use gradflow_core::detect::{RunContext, Thresholds};
use gradflow_protocol::{Amendment, RunRegistration};
use rustc_hash::{FxHashMap, FxHashSet};

/// A registration in force (as first sent, with every amendment up to some step
/// applied) and the lookups ingest derives from it.
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
