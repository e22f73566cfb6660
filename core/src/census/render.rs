//! A heap census in the forms people read: a text top list (`rubyspy
//! heap`), the classes that grew between two censuses (`rubyspy heap --diff`), and pprof in
//! the shape of Go's heap profiles (`/debug/pprof/heap`): sample types `inuse_objects` and
//! `inuse_space`, one sample per class whose "stack" is its type (root) and its class
//! (leaf), so `go tool pprof -top` lists classes and a flame graph groups them by type.
use super::{Census, ClassDelta, ClassRow};
use crate::output::pprof::{proto, Strings};
use crate::output::Interner;
use flate2::write::GzEncoder;
use prost::Message;
use std::fmt::Write as _;
use std::io::Write;

/// How a class's row is named where a name is needed: what `ObjectSpace.each_object` does
/// not yield (name "") as "(hidden T_STRING)", and the classes among it, which are the
/// metaclasses Ruby hides, as "(singleton classes)".
pub fn row_name(name: &str, type_name: &str) -> String {
    match (name, type_name) {
        ("", "T_CLASS") => "(singleton classes)".to_string(),
        ("", _) => format!("(hidden {type_name})"),
        _ => name.to_string(),
    }
}

/// Bytes as people read them: "512 B", "1.5 KiB", "12.0 MiB".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The census as text: what was read, then the top `limit` classes by bytes.
pub fn text(census: &Census, limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "heap of pid {} (Ruby {}): {} live objects in {} slots of {} pages ({}), {} free; \
         read {} in {:.1} ms{}",
        census.pid,
        census.ruby_version,
        census.live_slots,
        census.total_slots,
        census.pages,
        human_bytes(census.heap_bytes_total),
        census.free_slots,
        human_bytes(census.bytes_read),
        census.duration_us as f64 / 1000.0,
        if census.partial {
            " (PARTIAL: stopped at max_bytes)"
        } else {
            ""
        }
    );
    let odd = [
        (census.zombie_slots, "awaiting finalizers"),
        (census.moved_slots, "moved by compaction"),
        (census.garbage_slots, "garbage not yet swept"),
        (
            census.unreadable_pages,
            "pages unreadable (changed while read)",
        ),
    ];
    for (n, what) in odd.iter().filter(|(n, _)| *n > 0) {
        let _ = writeln!(out, "  {n} {what}");
    }
    if census.moving {
        let _ = writeln!(
            out,
            "  compactions kept moving objects while they were read: counts are approximate"
        );
    }
    if census.pages_changed {
        let _ = writeln!(
            out,
            "  the GC freed pages while the page list was read: counts are approximate"
        );
    }
    if census.heaps_changed {
        let _ = writeln!(
            out,
            "  Ractors started or ended while their heaps were read: counts are approximate"
        );
    }
    ractor_lines(&mut out, census);
    let _ = writeln!(
        out,
        "\n{:>12} {:>12} {:>12}  class (type)",
        "objects", "bytes", "outside slot"
    );
    for row in census.classes.iter().take(limit) {
        let _ = writeln!(
            out,
            "{:>12} {:>12} {:>12}  {} ({})",
            row.objects,
            human_bytes(row.bytes()),
            human_bytes(row.heap_bytes),
            row_name(&row.name, &row.type_name),
            row.type_name
        );
    }
    if census.classes.len() > limit {
        let _ = writeln!(out, "  ... {} more classes", census.classes.len() - limit);
    }
    let _ = writeln!(out, "\nnot counted: {}", census.not_counted);
    out
}

/// One line per heap where each Ractor owns one (a single Ractor's says nothing more).
fn ractor_lines(out: &mut String, census: &Census) {
    for r in census.ractors.iter().filter(|_| census.ractors.len() > 1) {
        let who = match (r.id, &r.name) {
            (Some(id), Some(name)) => format!("Ractor {id} ({name})"),
            (Some(id), None) => format!("Ractor {id}"),
            _ => "a Ractor".to_string(),
        };
        let _ = writeln!(
            out,
            "  {who}, {}: {} live objects, {}, in {} pages",
            r.state,
            r.objects,
            human_bytes(r.slot_bytes.saturating_add(r.heap_bytes)),
            r.pages
        );
    }
}

/// The changes `Census::diff` found, as text: the `limit` that grew most, then those that
/// shrank most.
pub fn diff_text(deltas: &[ClassDelta], limit: usize) -> String {
    let mut out = String::new();
    let grew: Vec<&ClassDelta> = deltas
        .iter()
        .filter(|d| d.bytes > 0 || (d.bytes == 0 && d.objects > 0))
        .collect();
    let mut shrank: Vec<&ClassDelta> = deltas
        .iter()
        .filter(|d| d.bytes < 0 || (d.bytes == 0 && d.objects < 0))
        .collect();
    shrank.sort_by_key(|d| d.bytes);
    for (title, rows) in [("grew", grew), ("shrank", shrank)] {
        let _ = writeln!(out, "{} classes {title}", rows.len());
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "{:>12} {:>12} {:>12} {:>12}  class (type)",
            "objects", "bytes", "objects now", "bytes now"
        );
        for d in rows.iter().take(limit) {
            let _ = writeln!(
                out,
                "{:>+12} {:>12} {:>12} {:>12}  {} ({})",
                d.objects,
                signed_bytes(d.bytes),
                d.objects_now,
                human_bytes(d.bytes_now),
                row_name(&d.name, &d.type_name),
                d.type_name
            );
        }
    }
    out
}

fn signed_bytes(bytes: i64) -> String {
    let sign = if bytes < 0 { "-" } else { "+" };
    format!("{sign}{}", human_bytes(bytes.unsigned_abs()))
}

/// pprof's string table, and one function (and one location of the same id) per frame
/// name: the function of the name with string id `n` is `names.id(n) + 1`.
struct Table {
    strings: Strings,
    names: Interner<i64>,
}

impl Table {
    fn id(&mut self, s: &str) -> i64 {
        self.strings.id(s)
    }

    fn frame(&mut self, name: &str) -> u64 {
        let name = self.id(name);
        self.names.id(name) as u64 + 1
    }
}

/// The census as a pprof heap profile (see the module docs), gzipped.
pub fn pprof(census: &Census) -> Vec<u8> {
    let mut t = Table {
        strings: Strings::new(),
        names: Interner::default(),
    };
    let value_type = |t: &mut Table, kind, unit| proto::ValueType {
        r#type: t.id(kind),
        unit: t.id(unit),
    };
    let sample_type = vec![
        value_type(&mut t, "inuse_objects", "count"),
        value_type(&mut t, "inuse_space", "bytes"),
    ];
    let period_type = Some(value_type(&mut t, "space", "bytes"));
    let sample = census
        .classes
        .iter()
        .map(|row: &ClassRow| proto::Sample {
            location_id: vec![
                t.frame(&row_name(&row.name, &row.type_name)),
                t.frame(&row.type_name),
            ],
            value: vec![row.objects as i64, row.bytes() as i64],
            label: Vec::new(),
        })
        .collect();
    let function: Vec<proto::Function> = (t.names.list.iter().enumerate())
        .map(|(i, name)| proto::Function {
            id: i as u64 + 1,
            name: *name,
            ..Default::default()
        })
        .collect();
    let location = function
        .iter()
        .map(|f| proto::Location {
            id: f.id,
            line: vec![proto::Line {
                function_id: f.id,
                line: 0,
            }],
            ..Default::default()
        })
        .collect();
    let comment = vec![
        t.id(&format!(
            "rbspy_ext heap census of pid {} (Ruby {})",
            census.pid, census.ruby_version
        )),
        t.id(&format!("not counted: {}", census.not_counted)),
    ];
    let profile = proto::Profile {
        sample_type,
        sample,
        location,
        function,
        // Saturating: a census file may say anything (found by the census_file fuzz target).
        time_nanos: (census.taken_at_ms as i64).saturating_mul(1_000_000),
        duration_nanos: (census.duration_us as i64).saturating_mul(1000),
        period_type,
        period: 1,
        comment,
        default_sample_type: 1,
        string_table: t.strings.table,
        ..Default::default()
    };
    let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing to a Vec cannot fail.
    let _ = gz.write_all(&profile.encode_to_vec());
    gz.finish().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::GzDecoder;
    use std::io::Read;

    #[test]
    fn pprof_has_a_sample_per_class_with_type_root_and_class_leaf() {
        let census = Census {
            classes: vec![
                ClassRow {
                    name: "Widget".into(),
                    type_name: "T_OBJECT".into(),
                    objects: 3,
                    slot_bytes: 120,
                    heap_bytes: 0,
                },
                ClassRow {
                    name: String::new(),
                    type_name: "T_STRING".into(),
                    objects: 2,
                    slot_bytes: 80,
                    heap_bytes: 10,
                },
                ClassRow {
                    name: String::new(),
                    type_name: "T_CLASS".into(),
                    objects: 1,
                    slot_bytes: 40,
                    heap_bytes: 0,
                },
            ],
            ..Census::default()
        };
        let mut bytes = Vec::new();
        GzDecoder::new(&pprof(&census)[..])
            .read_to_end(&mut bytes)
            .unwrap();
        let p = proto::Profile::decode(&bytes[..]).unwrap();
        let name = |loc: u64| {
            let f = p.function.iter().find(|f| f.id == loc).unwrap();
            p.string_table[f.name as usize].clone()
        };
        let got: Vec<(String, String, Vec<i64>)> = p
            .sample
            .iter()
            .map(|s| {
                (
                    name(s.location_id[0]),
                    name(s.location_id[1]),
                    s.value.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("Widget".into(), "T_OBJECT".into(), vec![3, 120]),
                ("(hidden T_STRING)".into(), "T_STRING".into(), vec![2, 90]),
                ("(singleton classes)".into(), "T_CLASS".into(), vec![1, 40])
            ]
        );
        assert_eq!(
            p.string_table[p.sample_type[1].r#type as usize],
            "inuse_space"
        );
    }
}
