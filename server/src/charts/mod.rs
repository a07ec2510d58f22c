//! Charts drawn by the server with plotters, as SVG or PNG.
//!
//! # Layout
//!
//! - [`shapes`]: what a chart is made of (lines, bands, axes, panels, the heatmap's
//!   cells), imported by every other chart module and importing none.
//! - [`reads`]: the store reads every chart shares (a series as a line, an alert's
//!   episodes as bands).
//! - [`data`]: what each chart shows, gathered from the store's rollups and the
//!   run's alerts.
//! - [`lines`]: line charts (group norms, norm drift, loss scale, loss, GPU).
//! - [`grad_flow`]: the module × step heatmap that shows a cut graph at a glance.
//! - [`user_metrics`]: the run's own `metrics` (reward, accuracy, …), a panel each,
//!   drawn by [`panels`] as small multiples of [`lines`] charts.
//! - [`signals`]: the per-layer views of the instability signals (attention logits,
//!   Adam updates, MoE loads), a line per module, drawn by [`lines`].
//! - [`compare`]: one metric of several runs, a line per run, drawn by [`lines`].
//! - [`ranks`]: a multi-rank run's ranks (where each stands) and one metric per
//!   rank, a line per rank, drawn by [`lines`].
//!
//! Shared sizes, fonts and colours live here. Drawing is CPU work: the handler runs
//! it in `spawn_blocking`.

pub mod compare;
pub mod data;
pub mod grad_flow;
pub mod lines;
pub mod panels;
pub mod ranks;
pub mod reads;
pub mod shapes;
pub mod signals;
pub mod user_metrics;

use std::sync::Once;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;

pub use shapes::ChartData;

gradflow_protocol::vocabulary! {
    /// The charts `GET /api/v1/runs/{run_id}/charts/{chart}.{svg,png}` serves.
    pub enum ChartKind {
        GradFlow = "grad-flow",
        GroupGradNorms = "group-grad-norms",
        NormDrift = "norm-drift",
        Scaler = "scaler",
        Loss = "loss",
        Gpu = "gpu",
        Metrics = "metrics",
        AttentionLogits = "attention-logits",
        AdamUpdates = "adam-updates",
        MoeLoads = "moe-loads",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Svg,
    Png,
}

pub const DEFAULT_WIDTH: u32 = 900;
pub const DEFAULT_HEIGHT: u32 = 420;
pub const MIN_SIDE: u32 = 300;
pub const MAX_SIDE: u32 = 4000;

pub const FONT: &str = "sans-serif";
pub const TITLE_SIZE: u32 = 18;
pub const LABEL_SIZE: u32 = 13;

/// Series colours (Tableau 10): distinct, and legible on white.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// Alert episodes.
pub const BAND: RGBColor = RGBColor(214, 39, 40);
/// NaN and infinity: nothing else is this colour.
pub const NON_FINITE: RGBColor = RGBColor(255, 0, 255);
/// Gradient norm exactly zero.
pub const ZERO: RGBColor = RGBColor(0, 0, 0);
/// No gradient: backward never reached the module.
pub const NOT_REACHED: RGBColor = RGBColor(190, 190, 190);

/// The font charts are laid out (and PNGs drawn) with.
static FONT_BYTES: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
static REGISTER_FONT: Once = Once::new();

/// Draws `chart` as `format` at `width` × `height`.
pub fn render(
    chart: &ChartData,
    format: Format,
    width: u32,
    height: u32,
) -> anyhow::Result<Vec<u8>> {
    // plotters measures text through the registered font for every backend (SVG
    // layout too), so register it before any drawing.
    REGISTER_FONT.call_once(|| {
        if plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).is_err() {
            tracing::error!("the bundled chart font could not be loaded");
        }
    });
    match format {
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
                draw(&root, chart)?;
                root.present().context("finishing the SVG")?;
            }
            Ok(svg.into_bytes())
        }
        Format::Png => {
            let mut pixels = vec![0u8; width as usize * height as usize * 3];
            {
                let root =
                    BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
                draw(&root, chart)?;
                root.present().context("finishing the bitmap")?;
            }
            let mut png = Vec::new();
            let mut encoder = png::Encoder::new(&mut png, width, height);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let mut writer = encoder.write_header().context("encoding PNG")?;
            writer.write_image_data(&pixels).context("encoding PNG")?;
            writer.finish().context("encoding PNG")?;
            Ok(png)
        }
    }
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &ChartData) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(plot_error)?;
    match chart {
        ChartData::Lines(chart) => lines::draw(root, chart),
        ChartData::GradFlow(chart) => grad_flow::draw(root, chart),
        ChartData::Panels(chart) => panels::draw(root, chart),
    }
}

/// plotters' errors carry the backend's error type; make them plain.
pub(crate) fn plot_error<E: std::fmt::Debug>(error: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {error:?}")
}

/// `text` cut from the front (`…` standing for what is cut) until it is at most
/// `max_px` wide in `font`.
pub(crate) fn fit_from_the_end<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    text: &str,
    font: &TextStyle<'_>,
    max_px: i32,
) -> String {
    let width = |t: &str| {
        root.estimate_text_size(t, font)
            .map_or(0, |(w, _)| w as i32)
    };
    if width(text) <= max_px {
        return text.to_owned();
    }
    let chars: Vec<char> = text.chars().collect();
    (1..chars.len())
        .map(|cut| format!("…{}", chars[cut..].iter().collect::<String>()))
        .find(|t| width(t) <= max_px)
        .unwrap_or_default()
}

/// Tick labels for log10 axes: the value 10^exponent with two significant digits
/// (`0.0032`, `3.2`, `3.2e-7`).
pub(crate) fn power_of_ten_label(exponent: f64) -> String {
    let value = 10f64.powf(exponent);
    if (-3.0..4.0).contains(&exponent) {
        let decimals = (1.0 - exponent.floor()).max(0.0) as usize;
        let text = format!("{value:.decimals$}");
        if text.contains('.') {
            text.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            text
        }
    } else {
        format!("{value:.1e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_ticks_read_with_two_significant_digits() {
        assert_eq!(power_of_ten_label(0.0), "1");
        assert_eq!(power_of_ten_label(0.5), "3.2");
        assert_eq!(power_of_ten_label(-2.5), "0.0032");
        assert_eq!(power_of_ten_label(3.0), "1000");
        assert_eq!(power_of_ten_label(-6.5), "3.2e-7");
    }
}
