//! Sampled allocations as Go's heap profiles (`/debug/pprof/heap` and `/debug/pprof/allocs`):
//! sample types `alloc_objects`/count, `alloc_space`/bytes, `inuse_objects`/count and
//! `inuse_space`/bytes, already scaled (see the module docs of `allocs`); period type
//! `space`/bytes with the rate as period. One sample per site, its stack leaf first (a
//! function per label and path, as in the CPU profiles' pprof), labelled `class` and `type`,
//! and with the numeric label `bytes` (the site's mean object size, unit bytes) that Go puts
//! on its heap samples. The two endpoints differ only in the type a viewer opens on:
//! `inuse_space` for heap, `alloc_space` for allocs, as Go's do.
use super::{AllocProfile, SiteCounts};
use crate::output::pprof::{frame_locations, proto, Locations, Strings};
use flate2::write::GzEncoder;
use prost::Message;
use std::io::Write;

/// Which sample type a viewer opens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opens {
    /// `inuse_space`: what `/debug/pprof/heap` serves.
    Inuse,
    /// `alloc_space`: what `/debug/pprof/allocs` serves.
    Allocs,
}

/// The message, before encoding (tests decode and compare against it).
pub fn build(profile: &AllocProfile, opens: Opens) -> Result<proto::Profile, String> {
    profile.check()?;
    let profile = &*profile.frameless_named();
    let mut strings = Strings::new();
    let mut locations = Locations::default();
    let frames = frame_locations(&profile.frames, &mut strings, &mut locations);
    let mut value_type = |kind: &str, unit: &str| proto::ValueType {
        r#type: strings.id(kind),
        unit: strings.id(unit),
    };
    let sample_type = vec![
        value_type("alloc_objects", "count"),
        value_type("alloc_space", "bytes"),
        value_type("inuse_objects", "count"),
        value_type("inuse_space", "bytes"),
    ];
    let period_type = Some(value_type("space", "bytes"));
    let keys = ["class", "type", "bytes"].map(|s| strings.id(s));
    let sample = profile
        .sites
        .iter()
        .map(|site| {
            let e = site.estimates();
            proto::Sample {
                location_id: site.frames.iter().map(|&f| frames[f as usize]).collect(),
                value: [
                    e.alloc_objects,
                    e.alloc_space,
                    e.inuse_objects,
                    e.inuse_space,
                ]
                .map(|v| i64::try_from(v).unwrap_or(i64::MAX))
                .to_vec(),
                label: labels(&mut strings, keys, site),
            }
        })
        .collect();
    let mut comment = vec![
        format!("rbspy_ext {} allocations", env!("CARGO_PKG_VERSION")),
        format!("pid {}", profile.pid),
        format!("Ruby {}", profile.ruby_version),
        format!(
            "one sample every {} bytes allocated, on average",
            profile.rate_bytes
        ),
    ];
    comment.extend(profile.notes.iter().cloned());
    let comment = comment.iter().map(|c| strings.id(c)).collect();
    let default_sample_type = match opens {
        Opens::Inuse => strings.id("inuse_space"),
        Opens::Allocs => strings.id("alloc_space"),
    };
    Ok(proto::Profile {
        sample_type,
        sample,
        location: locations.locations,
        function: locations.functions,
        time_nanos: i64::try_from(profile.start_unix_ns).unwrap_or(i64::MAX),
        duration_nanos: i64::try_from(profile.duration_ns).unwrap_or(i64::MAX),
        period_type,
        period: i64::try_from(profile.rate_bytes).unwrap_or(i64::MAX),
        comment,
        default_sample_type,
        string_table: strings.table,
        ..Default::default()
    })
}

/// A site's labels: `class` and `type` as text, and its objects' mean size as `bytes`.
fn labels(
    strings: &mut Strings,
    [class, type_key, bytes]: [i64; 3],
    site: &SiteCounts,
) -> Vec<proto::Label> {
    let mean = site.sampled_bytes.checked_div(site.samples).unwrap_or(0);
    vec![
        proto::Label {
            key: class,
            str: strings.id(&site.class),
            ..Default::default()
        },
        proto::Label {
            key: type_key,
            str: strings.id(&site.type_name),
            ..Default::default()
        },
        proto::Label {
            key: bytes,
            num: i64::try_from(mean).unwrap_or(i64::MAX),
            num_unit: bytes,
            ..Default::default()
        },
    ]
}

/// The gzipped profile.
pub fn write(profile: &AllocProfile, opens: Opens, out: &mut dyn Write) -> Result<(), String> {
    let message = build(profile, opens)?;
    let mut gz = GzEncoder::new(out, flate2::Compression::default());
    gz.write_all(&message.encode_to_vec())
        .and_then(|_| gz.finish().map(|_| ()))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::frame;
    use flate2::read::GzDecoder;
    use std::io::Read;

    fn profile() -> AllocProfile {
        let mut strings = SiteCounts {
            frames: vec![0, 1],
            class: "String".into(),
            type_name: "T_STRING".into(),
            ..Default::default()
        };
        for _ in 0..5 {
            strings.add(40, 1);
        }
        strings.free(40, 1);
        let mut foos = SiteCounts {
            frames: vec![2, 1],
            class: "Foo".into(),
            type_name: "T_OBJECT".into(),
            ..Default::default()
        };
        foos.add(80, 1);
        AllocProfile {
            pid: 7,
            ruby_version: "3.4.1".into(),
            rate_bytes: 1,
            frames: vec![
                frame("Integer#to_s", "app.rb", 3, true),
                frame("<main>", "app.rb", 3, false),
                frame("Foo.new", "app.rb", 4, true),
            ],
            sites: vec![strings, foos],
            ..Default::default()
        }
    }

    #[test]
    fn allocs_pprof_has_go_heap_sample_types_scaled_values_and_labels() {
        let mut out = Vec::new();
        write(&profile(), Opens::Allocs, &mut out).unwrap();
        let mut bytes = Vec::new();
        GzDecoder::new(&out[..]).read_to_end(&mut bytes).unwrap();
        let p = proto::Profile::decode(&bytes[..]).unwrap();
        let s = |i: i64| p.string_table[i as usize].as_str();
        let types: Vec<(&str, &str)> = p
            .sample_type
            .iter()
            .map(|t| (s(t.r#type), s(t.unit)))
            .collect();
        assert_eq!(
            types,
            [
                ("alloc_objects", "count"),
                ("alloc_space", "bytes"),
                ("inuse_objects", "count"),
                ("inuse_space", "bytes")
            ]
        );
        let period = p.period_type.as_ref().unwrap();
        assert_eq!(
            (s(period.r#type), s(period.unit), p.period),
            ("space", "bytes", 1)
        );
        assert_eq!(s(p.default_sample_type), "alloc_space");
        assert_eq!(p.sample[0].value, [5, 200, 4, 160]);
        assert_eq!(p.sample[1].value, [1, 80, 1, 80]);
        let label = |i: usize, k: &str| {
            p.sample[i]
                .label
                .iter()
                .find(|l| s(l.key) == k)
                .cloned()
                .unwrap()
        };
        assert_eq!(s(label(0, "class").str), "String");
        assert_eq!(s(label(1, "type").str), "T_OBJECT");
        assert_eq!(
            (label(1, "bytes").num, s(label(1, "bytes").num_unit)),
            (80, "bytes")
        );
        // Leaf first; the C function has no file, <main> has its line.
        let name = |loc: u64| {
            let l = &p.location[loc as usize - 1].line[0];
            let f = &p.function[l.function_id as usize - 1];
            (s(f.name).to_string(), s(f.filename).to_string(), l.line)
        };
        assert_eq!(
            name(p.sample[0].location_id[0]),
            ("Integer#to_s".into(), "".into(), 0)
        );
        assert_eq!(
            name(p.sample[0].location_id[1]),
            ("<main>".into(), "app.rb".into(), 3)
        );
        let heap = build(&profile(), Opens::Inuse).unwrap();
        assert_eq!(
            heap.string_table[heap.default_sample_type as usize],
            "inuse_space"
        );
    }

    #[test]
    fn allocs_pprof_refuses_a_site_naming_no_frame() {
        let mut bad = profile();
        bad.sites[0].frames.push(9);
        assert!(build(&bad, Opens::Inuse).unwrap_err().contains("frame 9"));
    }
}
