//! The markers and categories of the [`super::firefox`] format: what a thread waited for and
//! what it served, over the time it did.
//!
//! A marker covers a *run*: consecutive samples of one thread that share a state, a set of
//! tags or a span, with no gap between them (a sample holds until the thread's next one, or
//! for one period when that is more than two periods away). So a marker's duration is what
//! the samples say, within a period at each end, and its `samples` field is the samples it
//! covers.
//!
//! | marker | type | name | a run of samples |
//! |---|---|---|---|
//! | waiting for the GVL | `ThreadState` | `GVL wait` | waiting for the GVL |
//! | blocked | `ThreadState` | `Blocked` | blocked: sleep, IO, a mutex, a queue |
//! | without the GVL (BPF) | `ThreadState` | `Without GVL` | on a CPU without the GVL |
//! | GC | `GC` | `GC marking`, `GC sweeping`, `GC compacting`, `GC` | in one GC phase |
//! | a trace | `Trace` | the trace's endpoint, the last new one the span's samples name (`OrdersController#show`; a Rack span is `GET` until routed), else `span` | in one span (`span id`) |
//! | tags | `Tags` | the `endpoint` tag (the Rails and Rack integrations' `orders#show`), else the tags, `key=value ...` | with the same tags (trace labels aside) |
use crate::context::otel_thread::{
    ENDPOINT_LABEL, LOCAL_ROOT_LABEL, SPAN_ID_LABEL, TRACE_ID_LABEL,
};
use crate::model::ThreadState;
use crate::profile::Profile;
use serde_json::{json, Value};

/// The categories, by index: name, colour, subcategories. A sample's category is its leaf
/// frame's, so a state's category is given to the leaf of the samples in it.
pub const CATEGORIES: [(&str, &str, &[&str]); 7] = [
    ("Other", "grey", &["Other"]),
    // The profiler leaves samples of the category named "Idle" out of its CPU views unless
    // asked (pq's --include-idle), as our views leave out blocked samples.
    ("Idle", "transparent", &["Other"]),
    ("Ruby", "blue", &["Other"]),
    ("C function", "yellow", &["Other"]),
    ("GVL wait", "orange", &["Other"]),
    ("GC", "red", &["Other", "Marking", "Sweeping", "Compacting"]),
    ("Without GVL", "purple", &["Other"]),
];
pub const OTHER: u32 = 0;
pub const IDLE: u32 = 1;
pub const RUBY: u32 = 2;
pub const C_FUNCTION: u32 = 3;
pub const GVL_WAIT: u32 = 4;
pub const GC: u32 = 5;
pub const WITHOUT_GVL: u32 = 6;

/// The category and subcategory of the leaf of a sample in `state` (None: the leaf's own,
/// Ruby or C function).
pub fn state_category(state: ThreadState) -> Option<(u32, u32)> {
    match state {
        ThreadState::Running => None,
        ThreadState::Blocked => Some((IDLE, 0)),
        ThreadState::WaitingForGvl => Some((GVL_WAIT, 0)),
        ThreadState::Gc => Some((GC, 0)),
        ThreadState::GcMarking => Some((GC, 1)),
        ThreadState::GcSweeping => Some((GC, 2)),
        ThreadState::GcCompacting => Some((GC, 3)),
        ThreadState::NoGvl => Some((WITHOUT_GVL, 0)),
    }
}

/// The marker name and type of a run in `state` (None: running has no marker; its samples
/// say what it ran).
pub fn state_marker(state: ThreadState) -> Option<(&'static str, &'static str)> {
    match state {
        ThreadState::Running => None,
        ThreadState::WaitingForGvl => Some(("GVL wait", "ThreadState")),
        ThreadState::Blocked => Some(("Blocked", "ThreadState")),
        ThreadState::NoGvl => Some(("Without GVL", "ThreadState")),
        ThreadState::Gc => Some(("GC", "GC")),
        ThreadState::GcMarking => Some(("GC marking", "GC")),
        ThreadState::GcSweeping => Some(("GC sweeping", "GC")),
        ThreadState::GcCompacting => Some(("GC compacting", "GC")),
    }
}

/// The trace labels, which make `Trace` markers rather than `Tags` ones.
const TRACE_LABELS: [&str; 4] = [
    TRACE_ID_LABEL,
    SPAN_ID_LABEL,
    LOCAL_ROOT_LABEL,
    ENDPOINT_LABEL,
];

/// The tag a request's marker is named after: what the Rails and Rack integrations tag each
/// request with.
const ENDPOINT_TAG: &str = "endpoint";

/// One marker, its name as text (the writer interns it).
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    pub name: String,
    pub start_ms: f64,
    pub end_ms: f64,
    pub category: u32,
    pub data: Value,
}

/// A thread's markers, in the order of their runs' ends.
#[derive(Debug, Default)]
pub struct Markers(pub Vec<Marker>);

impl Markers {
    /// The format's marker table, names through `string` (the shared string table).
    pub fn into_json(self, mut string: impl FnMut(&str) -> u32) -> Value {
        let mut markers = self.0;
        // The profiler expects a thread's markers sorted by start.
        markers.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        json!({
            "length": markers.len(),
            "name": markers.iter().map(|m| string(&m.name)).collect::<Vec<_>>(),
            "startTime": markers.iter().map(|m| m.start_ms).collect::<Vec<_>>(),
            "endTime": markers.iter().map(|m| m.end_ms).collect::<Vec<_>>(),
            // 1: an interval, from startTime to endTime.
            "phase": markers.iter().map(|_| 1).collect::<Vec<_>>(),
            "category": markers.iter().map(|m| m.category).collect::<Vec<_>>(),
            "data": markers.into_iter().map(|m| m.data).collect::<Vec<_>>(),
        })
    }
}

/// A run being extended: its key, first sample's time, end so far and samples.
struct Run<K> {
    key: K,
    start_us: f64,
    end_us: f64,
    samples: u64,
}

/// Consecutive samples with the same `key` (None: no run), given each sample's span.
fn runs<K: PartialEq>(spans: &[(f64, f64)], keys: impl Iterator<Item = Option<K>>) -> Vec<Run<K>> {
    let mut done = Vec::new();
    let mut open: Option<Run<K>> = None;
    for (&(at, until), key) in spans.iter().zip(keys) {
        if let Some(run) = open.take() {
            match &key {
                Some(k) if *k == run.key && run.end_us == at => {
                    open = Some(Run {
                        end_us: until,
                        samples: run.samples + 1,
                        ..run
                    });
                    continue;
                }
                _ => done.push(run),
            }
        }
        open = key.map(|key| Run {
            key,
            start_us: at,
            end_us: until,
            samples: 1,
        });
    }
    done.extend(open);
    done
}

/// One thread's samples as the markers see them: each sample's stack and span of time.
struct Thread<'a> {
    profile: &'a Profile,
    samples: &'a [(u32, u32)],
    /// Each sample's time and the end of the time it holds, in µs.
    spans: Vec<(f64, f64)>,
}

impl Thread<'_> {
    fn stack(&self, s: u32) -> &crate::profile::StackCount {
        &self.profile.stacks[s as usize]
    }

    fn value(&self, s: u32, key: &str) -> Option<String> {
        self.profile
            .tag_value(self.stack(s), key)
            .map(str::to_string)
    }

    fn marker<K>(run: &Run<K>, name: String, category: u32, data: Value) -> Marker {
        Marker {
            name,
            start_ms: run.start_us / 1000.0,
            end_ms: run.end_us / 1000.0,
            category,
            data,
        }
    }

    /// A marker per run of samples in one state, but running.
    fn states(&self, markers: &mut Vec<Marker>) {
        let states = self.samples.iter().map(|&(_, s)| Some(self.stack(s).state));
        for run in runs(&self.spans, states) {
            let Some((name, kind)) = state_marker(run.key) else {
                continue;
            };
            let category = state_category(run.key).map_or(OTHER, |(c, _)| c);
            let data = match kind {
                "GC" => json!({"type": kind, "phase": run.key.name(), "samples": run.samples}),
                _ => json!({"type": kind, "state": run.key.name(), "samples": run.samples}),
            };
            markers.push(Self::marker(&run, name.to_string(), category, data));
        }
    }

    /// A marker per run of samples in one span, named by the endpoint its samples on this
    /// thread named last for the first time: a span is named as it goes (a Rack span is
    /// "GET" until ActionPack routes it), and a state saved before the rename and put back
    /// after it would name it "GET" again, which is no new name. A run cut by a gap in the
    /// samples is still the same span.
    fn traces(&self, markers: &mut Vec<Marker>) {
        let traces: Vec<_> = self
            .samples
            .iter()
            .map(|&(_, s)| {
                let ids = (self.value(s, TRACE_ID_LABEL), self.value(s, SPAN_ID_LABEL));
                (ids.0.is_some() || ids.1.is_some()).then(|| (ids, self.value(s, LOCAL_ROOT_LABEL)))
            })
            .collect();
        let mut endpoints: std::collections::HashMap<_, Vec<String>> = Default::default();
        for (key, &(_, s)) in traces.iter().zip(self.samples) {
            if let (Some(key), Some(endpoint)) = (key, self.value(s, ENDPOINT_LABEL)) {
                let seen = endpoints.entry(key.clone()).or_default();
                if !seen.contains(&endpoint) {
                    seen.push(endpoint);
                }
            }
        }
        for run in runs(&self.spans, traces.iter().cloned()) {
            let endpoint = endpoints
                .get(&run.key)
                .and_then(|seen| seen.last().cloned());
            let ((trace, span), root) = &run.key;
            let data = json!({
                "type": "Trace",
                "endpoint": endpoint,
                "traceId": trace,
                "spanId": span,
                "localRootSpanId": root,
                "samples": run.samples,
            });
            let name = endpoint.unwrap_or_else(|| "span".to_string());
            markers.push(Self::marker(&run, name, OTHER, data));
        }
    }

    /// A marker per run of samples with the same tags (trace labels aside), named by what
    /// was served (the `endpoint` tag), so that a thread's requests group by action.
    fn tags(&self, markers: &mut Vec<Marker>) {
        let tags = self.samples.iter().map(|&(_, s)| {
            let text: Vec<String> = self
                .profile
                .tags_of(self.stack(s))
                .iter()
                .filter(|(k, _)| !TRACE_LABELS.contains(&k.as_str()))
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            (!text.is_empty()).then(|| (text.join(" "), self.value(s, ENDPOINT_TAG)))
        });
        for run in runs(&self.spans, tags) {
            let (text, endpoint) = &run.key;
            let data = json!({"type": "Tags", "tags": text, "samples": run.samples});
            let name = endpoint.clone().unwrap_or_else(|| text.clone());
            markers.push(Self::marker(&run, name, OTHER, data));
        }
    }
}

/// The markers of one thread from its samples (time in µs, index into `profile.stacks`):
/// a sample holds until the next, or for one period when that is more than two away.
pub fn thread_markers(profile: &Profile, samples: &[(u32, u32)], period_us: f64) -> Markers {
    let spans: Vec<(f64, f64)> = samples
        .iter()
        .enumerate()
        .map(|(i, &(at, _))| {
            let at = f64::from(at);
            let until = match samples.get(i + 1) {
                Some(&(next, _)) if f64::from(next) - at <= 2.0 * period_us => f64::from(next),
                _ => at + period_us,
            };
            (at, until)
        })
        .collect();
    let thread = Thread {
        profile,
        samples,
        spans,
    };
    let mut markers = Vec::new();
    thread.states(&mut markers);
    thread.traces(&mut markers);
    thread.tags(&mut markers);
    Markers(markers)
}

/// The marker schema: how the profiler shows each type's fields.
pub fn schema() -> Value {
    let samples = json!({"key": "samples", "label": "Samples", "format": "integer"});
    let display = json!(["marker-chart", "marker-table", "timeline-overview"]);
    json!([
        {
            "name": "ThreadState",
            "display": display,
            "tableLabel": "{marker.name}: {marker.data.samples} samples",
            "chartLabel": "{marker.name}",
            "tooltipLabel": "{marker.name}",
            "description": "Samples of a thread in one state, in a row: waiting for the GVL, \
                            blocked (sleep, IO, a mutex, a queue), or on a CPU without the GVL.",
            "fields": [{"key": "state", "label": "State", "format": "string"}, samples],
        },
        {
            "name": "GC",
            "display": display,
            "tableLabel": "{marker.name}: {marker.data.samples} samples",
            "chartLabel": "{marker.name}",
            "tooltipLabel": "{marker.name}",
            "description": "Samples of the thread collecting garbage in one phase, in a row.",
            "fields": [{"key": "phase", "label": "Phase", "format": "string"}, samples],
        },
        {
            "name": "Trace",
            "display": display,
            "tableLabel": "{marker.name} trace {marker.data.traceId} span {marker.data.spanId}",
            "chartLabel": "{marker.name}",
            "tooltipLabel": "{marker.name}",
            "description": "Samples of the thread in one OpenTelemetry span, in a row.",
            "fields": [
                {"key": "endpoint", "label": "Endpoint", "format": "string"},
                {"key": "traceId", "label": "Trace id", "format": "string"},
                {"key": "spanId", "label": "Span id", "format": "string"},
                {"key": "localRootSpanId", "label": "Local root span id", "format": "string"},
                samples,
            ],
        },
        {
            "name": "Tags",
            "display": display,
            "tableLabel": "{marker.data.tags}",
            "chartLabel": "{marker.data.tags}",
            "tooltipLabel": "{marker.data.tags}",
            "description": "Samples of the thread with the same tags (RubySpy.tag), in a row.",
            "fields": [{"key": "tags", "label": "Tags", "format": "string"}, samples],
        },
    ])
}
