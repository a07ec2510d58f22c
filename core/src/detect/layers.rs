//! Stacks of numbered layers (`qwen.layers.3.mlp`): which stack a module sits in and
//! its number there, worked out once at registration ([`super::context`]) and read by
//! the depth detector ([`super::vanishing`]) on every step.

/// A module's place in a stack of numbered layers, worked out once at registration:
/// the depth detector reads it for every module on every step.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    /// Its number in the stack (`qwen.layers.3.mlp` → 3).
    pub index: usize,
    /// What the depth detector names the stack: the group when the stack sits right
    /// under it, else the stack's own name.
    pub stack_subject: String,
}

/// A module's layer: its number (the integer after a `layers`, `layer`, `h`, `blocks`
/// or `block` segment: `qwen.layers.3.mlp` → 3, `transformer.h.11.attn` → 11) and
/// the subject its stack is judged under.
pub fn layer_of(group: &str, module: &str) -> Option<Layer> {
    layer_stack(module).map(|(stack, index)| Layer {
        index,
        stack_subject: stack_subject(group, stack).to_owned(),
    })
}

/// The stack of numbered layers a module sits in and its number there: the name up
/// to the `layers`-like segment is the stack (`model.vision_tower.encoder.layers.3.mlp`
/// → `("model.vision_tower.encoder.layers", 3)`), so a vision-language model's vision
/// and language layers are two stacks, never summed per number.
pub fn layer_stack(module: &str) -> Option<(&str, usize)> {
    let mut offset = 0;
    let mut parts = module.split('.').peekable();
    while let Some(part) = parts.next() {
        let end = offset + part.len();
        if matches!(part, "layers" | "layer" | "h" | "blocks" | "block")
            && let Some(index) = parts.peek().and_then(|p| p.parse().ok())
        {
            return Some((&module[..end], index));
        }
        offset = end + 1;
    }
    None
}

/// The alert's subject for a stack: its group when the stack sits right under the
/// group (`qwen.layers` in `qwen`), else the stack's own name.
fn stack_subject<'a>(group: &'a str, stack: &'a str) -> &'a str {
    match stack
        .strip_prefix(group)
        .and_then(|rest| rest.strip_prefix('.'))
    {
        Some(rest) if !rest.contains('.') => group,
        _ => stack,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer_index(module: &str) -> Option<usize> {
        layer_of("", module).map(|layer| layer.index)
    }

    #[test]
    fn a_stack_right_under_its_group_is_judged_as_the_group() {
        let subject = |group, module| layer_of(group, module).map(|l| l.stack_subject);
        assert_eq!(
            subject("qwen", "qwen.layers.3.mlp").as_deref(),
            Some("qwen")
        );
        assert_eq!(
            subject("vlm", "vlm.vision.layers.3.mlp").as_deref(),
            Some("vlm.vision.layers")
        );
        assert_eq!(subject("qwen", "qwen.lm_head"), None);
    }

    #[test]
    fn layer_numbers_come_from_common_naming_schemes() {
        assert_eq!(layer_index("qwen.layers.3.mlp"), Some(3));
        assert_eq!(layer_index("transformer.h.11.attn"), Some(11));
        assert_eq!(layer_index("encoder.layer.0.output"), Some(0));
        assert_eq!(layer_index("qwen.norm"), None);
        assert_eq!(layer_index("qwen.layers.norm"), None);
        // Real Hugging Face names.
        assert_eq!(
            layer_stack("model.layers.7.self_attn.q_proj"),
            Some(("model.layers", 7))
        );
        assert_eq!(
            layer_stack("base_model.model.model.layers.2.mlp.up_proj.lora_A.default"),
            Some(("base_model.model.model.layers", 2))
        );
        assert_eq!(
            layer_stack("model.vision_tower.encoder.layers.11.mlp.fc1"),
            Some(("model.vision_tower.encoder.layers", 11))
        );
        assert_eq!(layer_stack("model.embed_tokens"), None);
        assert_eq!(layer_stack("lm_head"), None);
        assert_eq!(stack_subject("model", "model.layers"), "model");
        assert_eq!(
            stack_subject("model", "model.language_model.layers"),
            "model.language_model.layers"
        );
    }
}
