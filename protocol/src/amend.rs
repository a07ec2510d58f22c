//! v1.1: amending a run's registration while it trains.
//!
//! A step record may carry `amend`: changes to the registration that take effect at
//! that record's step. Travelling inside the record gives an amendment the record's
//! ordering, idempotency (a resent step is a duplicate, its amendment too) and the
//! client's spool for free.

use serde::{Deserialize, Serialize};

use crate::error::{InvalidBody, Path};
use crate::run::{
    Optimizer, ParamGroup, ParamSpec, Precision, RunRegistration, validate_param_groups,
    validate_params,
};
use crate::wiring::{WiringFinding, validate_wiring};

/// Changes to a run's registration, in force from the step of the record carrying it.
///
/// `params` and `param_groups` are upserts by name: a listed parameter (or group)
/// replaces the registered one of the same name whole, or is added. Nothing is ever
/// removed: a parameter that left the model is sent with `requires_grad: false` and
/// `in_optimizer: false`. `precision` replaces the fields it gives. *(v1.5)* `wiring`
/// adds findings the client made once training ran (a layer built inside `forward`);
/// one already registered (same kind, module and attribute) is not added twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Amendment {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<ParamSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub param_groups: Vec<ParamGroup>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wiring: Vec<WiringFinding>,
}

impl Amendment {
    pub(crate) fn validate(&self, path: &Path<'_>) -> Result<(), InvalidBody> {
        validate_params(&path.field("params"), &self.params)?;
        validate_param_groups(&path.field("param_groups"), &self.param_groups)?;
        validate_wiring(&path.field("wiring"), &self.wiring)
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
            && self.param_groups.is_empty()
            && self.precision.is_none()
            && self.wiring.is_empty()
    }
}

impl RunRegistration {
    /// This registration with `amendment` applied: parameters and parameter groups
    /// replaced by name or appended, precision fields overwritten where given.
    pub fn amend(&mut self, amendment: &Amendment) {
        for spec in &amendment.params {
            match self.params.iter_mut().find(|p| p.name == spec.name) {
                Some(existing) => *existing = spec.clone(),
                None => self.params.push(spec.clone()),
            }
        }
        if !amendment.param_groups.is_empty() {
            let groups = &mut self
                .optimizer
                .get_or_insert_with(Optimizer::default)
                .param_groups;
            for group in &amendment.param_groups {
                match groups.iter_mut().find(|g| g.name == group.name) {
                    Some(existing) => *existing = group.clone(),
                    None => groups.push(group.clone()),
                }
            }
        }
        for finding in &amendment.wiring {
            let known = self.wiring.iter().any(|w| {
                w.kind == finding.kind
                    && w.module == finding.module
                    && w.attribute == finding.attribute
            });
            if !known && self.wiring.len() < crate::wiring::MAX_WIRING_FINDINGS {
                self.wiring.push(finding.clone());
            }
        }
        if let Some(precision) = &amendment.precision {
            let current = self.precision.get_or_insert_with(Precision::default);
            if precision.param_dtype.is_some() {
                current.param_dtype = precision.param_dtype;
            }
            if precision.compute_dtype.is_some() {
                current.compute_dtype = precision.compute_dtype;
            }
            if precision.loss_scaler.is_some() {
                current.loss_scaler = precision.loss_scaler;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::StepRecord;

    fn registration() -> RunRegistration {
        RunRegistration::from_json(
            br#"{"optimizer": {"lr": 1e-3, "param_groups": [{"name": "0", "lr": 1e-3}]},
                 "params": [{"name": "a.w", "param_group": "0"},
                            {"name": "b.w", "requires_grad": false, "in_optimizer": false}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn an_amendment_replaces_by_name_and_appends() {
        let record: StepRecord = serde_json::from_str(
            r#"{"step": 30, "amend": {
                "params": [{"name": "b.w", "requires_grad": true, "in_optimizer": false},
                           {"name": "c.w"}],
                "param_groups": [{"name": "0", "lr": 0.0}, {"name": "1", "lr": 1e-4}],
                "precision": {"param_dtype": "bf16"}}}"#,
        )
        .unwrap();
        let mut reg = registration();
        reg.amend(record.amend.as_ref().unwrap());
        let names: Vec<&str> = reg.params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a.w", "b.w", "c.w"]);
        assert!(reg.params[1].requires_grad() && !reg.params[1].in_optimizer());
        let groups = &reg.optimizer.as_ref().unwrap().param_groups;
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].lr.map(|l| l.get()), Some(0.0));
        assert_eq!(
            reg.precision.unwrap().param_dtype,
            Some(crate::run::Dtype::Bf16)
        );
    }

    #[test]
    fn wiring_findings_are_added_once() {
        let record: StepRecord = serde_json::from_str(
            r#"{"step": 1, "amend": {"wiring": [
                {"kind": "params_created_in_forward", "module": "attention",
                 "attribute": "Linear", "params": 4}]}}"#,
        )
        .unwrap();
        let amendment = record.amend.as_ref().unwrap();
        assert!(!amendment.is_empty());
        let mut reg = registration();
        reg.amend(amendment);
        reg.amend(amendment);
        assert_eq!(reg.wiring.len(), 1);
        assert_eq!(
            reg.wiring[0].kind,
            crate::WiringKind::ParamsCreatedInForward
        );
    }

    #[test]
    fn invalid_amendments_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"[{"step": 1, "amend": {"params": [{"name": ""}]}}]"#,
                "steps[0].amend.params[0].name",
            ),
            (
                r#"[{"step": 1, "amend": {"param_groups": [{"name": "0", "lr": -1}]}}]"#,
                "steps[0].amend.param_groups[0].lr",
            ),
            (
                r#"[{"step": 1, "amend": {"params": [{"name": "a", "sharded": true}]}}]"#,
                "steps[0].amend.params[0].sharded",
            ),
            (r#"[{"step": 1, "lrs": {"0": "NaN"}}]"#, "steps[0].lrs.0"),
            (
                r#"[{"step": 1, "amend": {"wiring": [{"kind": "params_created_in_forward", "module": "a\u0007"}]}}]"#,
                "steps[0].amend.wiring[0].module",
            ),
            (
                r#"[{"step": 1, "params": [{"name": "a", "rounded_away": 5, "intended_nonzero": 4}]}]"#,
                "steps[0].params[0].rounded_away",
            ),
        ];
        for (body, path) in cases {
            let err = crate::parse_steps_json(body.as_bytes()).unwrap_err();
            assert_eq!(&err.path, path, "{body}: {err}");
        }
    }
}
