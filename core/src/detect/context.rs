//! What the detectors know of a run from its registration, indexed once.

use std::collections::BTreeMap;

// Looked up once per reported module per step: Fx hashing is several times faster
// than SipHash on short keys, and these keys come from the run's own registration.
use rustc_hash::FxHashMap as HashMap;

use gradflow_protocol::{Dtype, Optimizer, ParamGroup, Role, RunRegistration};

use super::thresholds::Thresholds;

/// A module with trainable parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleInfo {
    pub group: String,
    /// Where it sits in a stack of numbered layers, when its name says
    /// (`qwen.layers.3.mlp`).
    pub layer: Option<super::layers::Layer>,
}

/// A norm weight the frozen-weight detector watches.
#[derive(Debug, Clone, PartialEq)]
pub struct NormParam {
    pub group: String,
    /// The dtype the optimizer updates: the parameter's own, else the run's
    /// `precision.param_dtype`; `None` when neither says.
    pub dtype: Option<Dtype>,
    pub in_optimizer: bool,
    /// Registered as trainable. A weight registered as frozen is watched too: if its
    /// records carry gradients, something unfroze it after registration.
    pub requires_grad: bool,
    /// Its optimizer parameter group (v1.1), for the group's own lr.
    pub param_group: Option<String>,
    /// Elements, when the shape is known.
    pub numel: Option<u64>,
}

/// How an optimizer sizes its steps, as far as the server can model it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerFamily {
    /// Adam, AdamW, LAMB, Lion, Adafactor, Sophia: the gradient is normalised, so an
    /// element moves by lr·|m̂/√v̂|, at most about lr and often far less.
    Adam,
    /// Plain SGD (with or without momentum): lr times the gradient.
    Sgd,
    /// Anything else (Adagrad, RMSprop, Muon, Shampoo, …): no step model.
    Other,
}

/// The optimizer's step size model, from the registration.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerInfo {
    /// As registered, for texts ("AdamW").
    pub display_name: String,
    pub family: OptimizerFamily,
    pub lr: Option<f64>,
    pub weight_decay: f64,
    /// v1.1 parameter groups by name: (lr, weight decay), each falling back to the
    /// optimizer's.
    pub param_groups: BTreeMap<String, (Option<f64>, f64)>,
}

impl OptimizerInfo {
    /// The lr a parameter of `param_group` had at a step: the step's own figure for
    /// the group, else the group's registered lr, else the step's run-wide lr, else
    /// the optimizer's.
    pub fn lr_of(
        &self,
        param_group: Option<&str>,
        record: &gradflow_protocol::StepRecord,
    ) -> Option<f64> {
        if let Some(group) = param_group {
            if let Some(lr) = record.lrs.get(group) {
                return Some(lr.get());
            }
            if let Some((Some(lr), _)) = self.param_groups.get(group) {
                return Some(*lr);
            }
        }
        record.lr.map(|f| f.get()).or(self.lr)
    }

    pub fn weight_decay_of(&self, param_group: Option<&str>) -> f64 {
        param_group
            .and_then(|g| self.param_groups.get(g))
            .map_or(self.weight_decay, |(_, wd)| *wd)
    }
}

#[derive(Debug, Clone)]
pub struct RunContext {
    pub thresholds: Thresholds,
    pub registration: RunRegistration,
    /// Modules with at least one trainable (`requires_grad`) parameter.
    pub trainable_modules: HashMap<String, ModuleInfo>,
    /// Trainable modules per group, counted.
    pub trainable_modules_per_group: BTreeMap<String, usize>,
    /// Trainable norm weights by name.
    pub norm_params: HashMap<String, NormParam>,
    /// Every trainable parameter that is not a norm weight: name → group.
    pub other_trainable: HashMap<String, String>,
    pub optimizer: OptimizerInfo,
}

impl RunContext {
    pub fn new(registration: &RunRegistration, server_thresholds: Thresholds) -> RunContext {
        let registration = registration.clone().normalized();
        let run_dtype = registration.precision.as_ref().and_then(|p| p.param_dtype);
        let mut trainable_modules = HashMap::default();
        let mut norm_params = HashMap::default();
        let mut other_trainable = HashMap::default();
        for param in &registration.params {
            if param.role() == Role::Norm {
                norm_params.insert(
                    param.name.clone(),
                    NormParam {
                        group: param.group_name().to_owned(),
                        dtype: param.dtype.or(run_dtype),
                        in_optimizer: param.in_optimizer(),
                        requires_grad: param.requires_grad(),
                        param_group: param.param_group.clone(),
                        numel: param.shape.as_ref().map(|s| s.iter().product()),
                    },
                );
            }
            if !param.requires_grad() {
                continue;
            }
            if param.role() != Role::Norm {
                other_trainable.insert(param.name.clone(), param.group_name().to_owned());
            }
            trainable_modules.insert(
                param.module_name().to_owned(),
                ModuleInfo {
                    group: param.group_name().to_owned(),
                    layer: super::layers::layer_of(param.group_name(), param.module_name()),
                },
            );
        }
        let mut trainable_modules_per_group = BTreeMap::new();
        for module in trainable_modules.values() {
            *trainable_modules_per_group
                .entry(module.group.clone())
                .or_insert(0) += 1;
        }
        let optimizer = registration.optimizer.as_ref();
        let name = optimizer.and_then(|o| o.name.clone()).unwrap_or_default();
        let lower = name.to_ascii_lowercase();
        let optimizer = OptimizerInfo {
            display_name: if name.is_empty() {
                "the optimizer".into()
            } else {
                name.clone()
            },
            // Unnamed optimizers are taken as Adam-like: by far the common case.
            family: if name.is_empty()
                || ["adam", "lamb", "lion", "adafactor", "sophia"]
                    .iter()
                    .any(|n| lower.contains(n))
            {
                OptimizerFamily::Adam
            } else if lower.contains("sgd") {
                OptimizerFamily::Sgd
            } else {
                OptimizerFamily::Other
            },
            lr: optimizer.and_then(|o| o.lr).map(|f| f.get()),
            weight_decay: optimizer
                .and_then(|o| o.weight_decay)
                .map_or(0.0, |f| f.get()),
            param_groups: BTreeMap::new(),
        };
        let mut optimizer = optimizer;
        if let Some(groups) = registration.optimizer.as_ref().map(|o| &o.param_groups) {
            for group in groups {
                let lr = group.lr.map(|f| f.get()).or(optimizer.lr);
                let wd = group
                    .weight_decay
                    .map_or(optimizer.weight_decay, |f| f.get());
                optimizer.param_groups.insert(group.name.clone(), (lr, wd));
            }
        }
        let thresholds = server_thresholds.with_overrides(registration.detectors.as_ref());
        RunContext {
            thresholds,
            registration,
            trainable_modules,
            trainable_modules_per_group,
            norm_params,
            other_trainable,
            optimizer,
        }
    }

    /// The group of a trainable module, or `None` for a module without trainable
    /// parameters (its gradient being absent says nothing).
    pub fn trainable_group(&self, module: &str) -> Option<&str> {
        self.trainable_modules.get(module).map(|m| m.group.as_str())
    }

    /// An optimizer setting of parameter group `group` as registered: the group's
    /// own (`of_group`), or else the optimizer's (`of_optimizer`).
    pub fn group_setting<T>(
        &self,
        group: &str,
        of_group: impl Fn(&ParamGroup) -> Option<T>,
        of_optimizer: impl Fn(&Optimizer) -> Option<T>,
    ) -> Option<T> {
        let optimizer = self.registration.optimizer.as_ref()?;
        optimizer
            .param_groups
            .iter()
            .find(|g| g.name == group)
            .and_then(of_group)
            .or_else(|| of_optimizer(optimizer))
    }
}
