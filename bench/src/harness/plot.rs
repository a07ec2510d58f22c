//! The scaling plots of BENCHMARKS.md, drawn with plotters as SVG: for each sweep,
//! ingest throughput on the left and read latency on the right, against a
//! logarithmic x axis.

use std::sync::Once;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::scaling::Sweep;

/// The server's chart font: plotters lays out SVG text through a registered font.
static FONT_BYTES: &[u8] = include_bytes!("../../../server/assets/DejaVuSans.ttf");
static REGISTER_FONT: Once = Once::new();
const FONT: &str = "sans-serif";

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// The SVG of `sweep`.
pub fn sweep_svg(sweep: &Sweep) -> anyhow::Result<String> {
    REGISTER_FONT.call_once(|| {
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES);
    });
    anyhow::ensure!(
        !sweep.points.is_empty(),
        "no points to plot for {}",
        sweep.axis
    );
    let xs: Vec<f64> = sweep.points.iter().map(|p| p.x as f64).collect();
    let (x_lo, x_hi) = (xs[0] * 0.8, xs[xs.len() - 1] * 1.25);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 380)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(500);

        let rates: Vec<(f64, f64)> = sweep
            .points
            .iter()
            .map(|p| (p.x as f64, p.module_values_per_second / 1e6))
            .collect();
        let top = rates.iter().map(|r| r.1).fold(0.0, f64::max) * 1.2;
        let mut chart = ChartBuilder::on(&left)
            .caption(format!("ingest vs {}", sweep.axis), (FONT, 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..top.max(0.1))?;
        chart
            .configure_mesh()
            .x_desc(sweep.axis.as_str())
            .y_desc("M module values / s")
            .light_line_style(TRANSPARENT)
            .x_labels(8)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style((FONT, 12))
            .draw()?;
        chart.draw_series(LineSeries::new(rates.clone(), COLORS[0].stroke_width(2)))?;
        chart.draw_series(rates.iter().map(|&p| Circle::new(p, 4, COLORS[0].filled())))?;

        let names: Vec<String> = sweep.points[0]
            .queries
            .iter()
            .map(|q| q.name.clone())
            .collect();
        let series: Vec<Vec<(f64, f64)>> = (0..names.len())
            .map(|i| {
                sweep
                    .points
                    .iter()
                    .filter_map(|p| p.queries.get(i).map(|q| (p.x as f64, q.median_ms)))
                    .filter(|(_, ms)| ms.is_finite())
                    .collect()
            })
            .collect();
        let top = series.iter().flatten().map(|p| p.1).fold(0.0, f64::max) * 1.2;
        let mut chart = ChartBuilder::on(&right)
            .caption(format!("reads vs {}", sweep.axis), (FONT, 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..top.max(1.0))?;
        chart
            .configure_mesh()
            .x_desc(sweep.axis.as_str())
            .y_desc("median ms")
            .light_line_style(TRANSPARENT)
            .x_labels(8)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style((FONT, 12))
            .draw()?;
        for (i, (name, points)) in names.iter().zip(&series).enumerate() {
            let color = COLORS[(i + 1) % COLORS.len()];
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .label_font((FONT, 12))
            .draw()?;
        root.present().context("finishing the SVG")?;
    }
    Ok(svg)
}
