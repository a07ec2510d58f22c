//! The shapes of what a chart shows, apart from how they are read (`data`,
//! `user_metrics`, `compare`, `ranks`) and drawn (`lines`, `grad_flow`, `panels`):
//! every chart module imports them, so they import no chart module.

use gradflow_core::model::cell::{Cell, widen_for_display};

/// A line of a line chart. Non-finite values are kept apart: they cannot be plotted
/// but must be seen.
#[derive(Debug, Clone, Default)]
pub struct Line {
    pub label: String,
    pub points: Vec<(u64, f64)>,
    /// Steps whose value was NaN or infinite.
    pub nonfinite: Vec<u64>,
    /// Drawn thicker: the line of the module an alert names, among its layer's
    /// neighbours.
    pub emphasis: bool,
}

impl Line {
    /// The stroke's width in pixels.
    pub fn width(&self) -> u32 {
        if self.emphasis { 4 } else { 2 }
    }
}

/// A shaded stretch of steps (an alert's episode).
#[derive(Debug, Clone)]
pub struct Band {
    pub from: u64,
    pub to: u64,
    pub label: String,
}

#[derive(Debug, Clone)]
pub struct Axis {
    pub label: String,
    pub log: bool,
    pub lines: Vec<Line>,
}

/// Everything a line chart draws.
#[derive(Debug, Clone)]
pub struct LineChart {
    pub title: String,
    pub from: u64,
    pub to: u64,
    pub primary: Axis,
    pub secondary: Option<Axis>,
    pub bands: Vec<Band>,
    /// Steps marked on the x axis, with the legend label of the marks.
    pub markers: Vec<(String, Vec<u64>)>,
    /// Horizontal reference values on the primary axis, with their labels.
    pub references: Vec<(f64, String)>,
    /// Legend entries with no line: what the chart leaves out, said where the
    /// lines are named.
    pub notes: Vec<String>,
    pub legend: LegendPlace,
}

/// Where a line chart's legend goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegendPlace {
    /// Over the plot's upper right corner: a few entries.
    Inside,
    /// Beside the plot, right of it: many entries, which would cover the lines.
    Right,
    /// Under the plot, in as many columns as fit: long entries, or lines that
    /// fill the plot (the norm weights' drift and references, a norm per group).
    Below,
    /// None: a panel of one line, which its title names.
    None,
}

/// One cell of the gradient-flow heatmap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FlowCell {
    /// Not measured in this stretch.
    Absent,
    /// Reported without a gradient: backward never reached the module.
    NotReached,
    /// Gradient norm exactly 0.
    Zero,
    /// NaN or infinite.
    NonFinite,
    /// The largest gradient norm in the stretch.
    Norm(f64),
}

#[derive(Debug, Clone)]
pub struct GradFlow {
    pub title: String,
    pub from: u64,
    pub to: u64,
    /// Steps per column: every column is this wide on the step axis (the last one
    /// may hold fewer steps of the run).
    pub steps_per_column: u64,
    /// (module, group) in model order.
    pub modules: Vec<(String, String)>,
    /// `cells[module][column]`.
    pub cells: Vec<Vec<FlowCell>>,
}

/// Small multiples: a panel per series, each a line chart with its own value axis
/// and its name for a title, all on one step axis.
#[derive(Debug, Clone)]
pub struct Panels {
    pub title: String,
    pub from: u64,
    pub to: u64,
    pub panels: Vec<LineChart>,
}

#[derive(Debug, Clone)]
pub enum ChartData {
    Lines(LineChart),
    GradFlow(GradFlow),
    Panels(Panels),
}

/// Which steps and how many points.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub from: u64,
    pub to: u64,
    /// Points per line (about one per pixel column).
    pub points: usize,
}

/// A line of stored cells: finite values plotted, non-finite ones kept apart, and
/// with `null_as_zero` "reported without a gradient" drawn as 0.
pub fn line_of(label: &str, cells: Vec<(u64, Cell)>, null_as_zero: bool) -> Line {
    let mut line = Line {
        label: label.to_owned(),
        ..Line::default()
    };
    for (step, cell) in cells {
        match cell {
            Cell::Value(v) if v.is_finite() => line.points.push((step, widen_for_display(v))),
            Cell::Value(_) => line.nonfinite.push(step),
            Cell::Null if null_as_zero => line.points.push((step, 0.0)),
            Cell::Null | Cell::Absent => {}
        }
    }
    line
}
