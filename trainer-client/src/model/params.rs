//! Every parameter of the hybrid model, by its Hugging Face-style name, with what
//! the protocol's registration needs to know about it.

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use gradflow_protocol::Role;

/// One parameter tensor, stored in the master dtype the optimizer updates.
#[derive(Debug, Clone)]
pub struct Param {
    /// `qwen.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// `qwen.layers.3.self_attn.q_proj`.
    pub module: String,
    /// `qwen` or `agent`.
    pub group: String,
    pub role: Role,
    pub var: Var,
    pub in_optimizer: bool,
}

#[derive(Debug, Default)]
pub struct ParamStore {
    params: Vec<Param>,
    index: HashMap<String, usize>,
}

impl ParamStore {
    /// Adds a parameter with the given value (already in its master dtype).
    pub fn insert(&mut self, name: &str, role: Role, value: Tensor) -> candle_core::Result<Var> {
        let var = Var::from_tensor(&value)?;
        let module = gradflow_protocol::default_module(name).to_owned();
        let group = gradflow_protocol::default_group(name).to_owned();
        self.index.insert(name.to_owned(), self.params.len());
        self.params.push(Param {
            name: name.to_owned(),
            module,
            group,
            role,
            var: var.clone(),
            in_optimizer: true,
        });
        Ok(var)
    }

    pub fn get(&self, name: &str) -> Option<&Param> {
        self.index.get(name).map(|&i| &self.params[i])
    }

    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Marks every parameter of `group` as left out of the optimizer.
    pub fn exclude_group_from_optimizer(&mut self, group: &str) {
        for param in &mut self.params {
            if param.group == group {
                param.in_optimizer = false;
            }
        }
    }

    /// The variables the optimizer updates.
    pub fn optimizer_vars(&self) -> Vec<Var> {
        self.params
            .iter()
            .filter(|p| p.in_optimizer)
            .map(|p| p.var.clone())
            .collect()
    }

    /// Module names in model order (first appearance), each once.
    pub fn modules(&self) -> Vec<&str> {
        let mut seen = std::collections::HashSet::new();
        self.params
            .iter()
            .map(|p| p.module.as_str())
            .filter(|m| seen.insert(*m))
            .collect()
    }
}
