//! The kinds of series a run's steps carry: what a stored column holds, and what the
//! series API, the charts and the pages ask for.

use gradflow_protocol::vocabulary;

vocabulary! {
    /// What a column holds. The name is stored in the `columns` table; declaration
    /// order is the index tables of `ALL`'s length use (`columns.rs`).
    pub enum SeriesKind {
        Loss = "loss",
        Lr = "lr",
        ScalerScale = "scaler_scale",
        ScalerGrowthTracker = "scaler_growth_tracker",
        FoundInf = "found_inf",
        StepSkipped = "step_skipped",
        ModuleGradNorm = "module_grad_norm",
        HookHits = "hook_hits",
        GroupGradNorm = "group_grad_norm",
        ParamGradNorm = "param_grad_norm",
        UpdateNorm = "update_norm",
        Drift = "drift",
        ParamMean = "param_mean",
        Metric = "metric",
        GpuMemoryUsedBytes = "gpu_memory_used_bytes",
        GpuMemoryTotalBytes = "gpu_memory_total_bytes",
        GpuUtilizationPct = "gpu_utilization_pct",
        GpuTemperatureC = "gpu_temperature_c",
        GpuPowerW = "gpu_power_w",
        DroppedSteps = "dropped_steps",
        IntendedUpdateNorm = "intended_update_norm",
        IntendedUpdateMaxUlp = "intended_update_max_ulp",
        IntendedNonzero = "intended_nonzero",
        RoundedAway = "rounded_away",
        /// v1.4: a rank's own work on the step, seconds.
        StepTime = "step_time",
        /// v1.4: gradient elements a rank holds of a module.
        ModuleNumel = "module_numel",
        /// v1.4: how many of those are NaN or infinite.
        ModuleNonfinite = "module_nonfinite",
        /// v1.4: elements a rank holds of a parameter.
        ParamNumel = "param_numel",
        /// v1.2: whether the gradients were carried over an optimizer step (1 or 0).
        GradsCarriedOver = "grads_carried_over",
        /// v1.2: the largest absolute input value of the step.
        InputAbsmax = "input_absmax",
        /// v1.5: the sum of a module's weights a rank holds (a replica's fingerprint).
        ModuleParamSum = "module_param_sum",
        /// v1.7: whether a rank's own gradients were non-finite before the all-reduce
        /// (1 or 0).
        LocalGradsNonfinite = "local_grads_nonfinite",
        /// v1.9: the optimizer steps since the client's previous step record call.
        OptimizerSteps = "optimizer_steps",
        /// v1.8: an attention module's largest pre-softmax logit.
        AttnMaxLogit = "attn_max_logit",
        /// v1.8: an attention module's smallest head entropy (nats).
        AttnMinEntropy = "attn_min_entropy",
        /// v1.8: the RMS of a module's output.
        ActRms = "act_rms",
        /// v1.8: the largest absolute value of a module's output.
        ActAbsmax = "act_absmax",
        /// v1.8: Adam's elements with v > 0, of a module.
        AdamUpdated = "adam_updated",
        /// v1.8: the fraction of those with √v̂ < ε.
        AdamBelowEps = "adam_below_eps",
        /// v1.8: the RMS of Adam's update over the lr.
        AdamUpdateRms = "adam_update_rms",
        /// v1.8: the largest |m̂/(√v̂+ε)|.
        AdamUpdateAbsmax = "adam_update_absmax",
        /// v1.8: the mean log Z of the output logits.
        OutputLogzMean = "output_logz_mean",
        /// v1.8: the largest absolute output logit.
        OutputLogitAbsmax = "output_logit_absmax",
        /// v1.8: tokens routed to one expert; the subject is `layer/expert`.
        MoeExpertTokens = "moe_expert_tokens",
        /// v1.8: an MoE layer's router z.
        MoeRouterZ = "moe_router_z",
        /// v1.8, derived: the share of an MoE layer's tokens its busiest expert took.
        MoeTopShare = "moe_top_share",
        /// v1.8, derived: an MoE layer's MaxVio, (max load − mean load) / mean load.
        MoeMaxVio = "moe_max_vio",
        /// v1.8, derived: an MoE layer's experts that got no token.
        MoeIdleExperts = "moe_idle_experts",
        /// v1.8: one micro-batch's loss; the subject is its index in the step.
        MicroLoss = "micro_loss",
        /// v1.9: the step's largest share of one token id within a sequence.
        RepeatedTokenShare = "repeated_token_share",
        /// v1.9: the output logits' mean over the vocabulary and tokens.
        OutputLogitMean = "output_logit_mean",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_names() {
        for kind in SeriesKind::ALL {
            assert_eq!(SeriesKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(SeriesKind::parse("nope"), None);
    }

    #[test]
    fn every_kind_is_listed_in_declaration_order() {
        // `kind as usize` indexes tables of ALL's length (columns.rs).
        for (i, kind) in SeriesKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i, "{kind:?}");
        }
    }
}
