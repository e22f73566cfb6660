//! Live objects by class and by allocation site: a census of the heap (census/) joined
//! with the live set a tracking process publishes (allocs/published.rs). The census says what is
//! alive now, class by class, counted from the heap; the sampled objects still in their
//! slots (`published::still_there`) say which code allocated them. A class's sites are
//! matched by its name and type, as both sides name classes the same way (`rb_class_path`
//! in the tracker, `Kernel#class`'s path in the census).
use crate::allocs::published::{self, LiveSet, Unpublished};
use crate::allocs::{AllocProfile, SiteCounts};
use crate::census::render::{human_bytes, row_name};
use crate::census::Census;
use crate::memory::Memory;
use crate::process::{find_extension_symbol, read_maps};
use rustc_hash::FxHashMap;
use std::fmt::Write;

/// One allocation site's share of a class's live objects, as the samples still there
/// estimate it.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteShare {
    /// Index into the joined profile's `sites`.
    pub site: usize,
    pub samples: u64,
    pub objects: u64,
    /// Slot bytes (what a sample weighs): outside buffers are the census's alone.
    pub bytes: u64,
}

/// A census row and its sites, most estimated bytes first.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassSites {
    pub name: String,
    pub type_name: String,
    pub objects: u64,
    pub bytes: u64,
    pub sites: Vec<SiteShare>,
}

/// The join: the census's classes with sites, and the profile whose live counts are the
/// samples still there.
#[derive(Debug, Clone)]
pub struct Joined {
    pub classes: Vec<ClassSites>,
    pub profile: AllocProfile,
    /// Whether the tracker was running, its samples still there, and those gone since the
    /// last GC it saw.
    pub tracking: bool,
    pub there: u64,
    pub gone: u64,
    pub published_at_ms: u64,
}

/// Joins `census` with `set`, whose samples `there` says are still in their slots.
pub fn join(census: &Census, set: &LiveSet, there: &[bool]) -> Joined {
    let rate = set.profile.rate_bytes;
    let mut profile = set.profile.clone();
    for s in &mut profile.sites {
        *s = SiteCounts {
            live_samples: 0,
            live_bytes: 0,
            live_weight: 0.0,
            live_weighted_bytes: 0.0,
            ..s.clone()
        };
    }
    let mut shares: FxHashMap<usize, SiteShare> = FxHashMap::default();
    let (mut kept, mut gone) = (0, 0);
    for (sample, &is_there) in set.live.iter().zip(there) {
        if !is_there {
            gone += 1;
            continue;
        }
        kept += 1;
        let site = sample.site as usize;
        let share = shares.entry(site).or_insert(SiteShare {
            site,
            samples: 0,
            objects: 0,
            bytes: 0,
        });
        let times = u64::from(sample.times.max(1));
        let rate = if sample.rate > 0 { sample.rate } else { rate };
        profile.sites[site].add_live(sample.size as u64, rate, times);
        share.samples += times;
    }
    for share in shares.values_mut() {
        let s = &profile.sites[share.site];
        share.objects = s.live_weight.round() as u64;
        share.bytes = s.live_weighted_bytes.round() as u64;
    }
    let mut by_class: FxHashMap<(&str, &str), Vec<SiteShare>> = FxHashMap::default();
    for share in shares.into_values() {
        let s = &profile.sites[share.site];
        by_class
            .entry((s.class.as_str(), s.type_name.as_str()))
            .or_default()
            .push(share);
    }
    let classes = (census.classes.iter())
        .map(|row| {
            let mut sites = by_class
                .remove(&(row.name.as_str(), row.type_name.as_str()))
                .unwrap_or_default();
            sites.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.site.cmp(&b.site)));
            ClassSites {
                name: row.name.clone(),
                type_name: row.type_name.clone(),
                objects: row.objects,
                bytes: row.bytes(),
                sites,
            }
        })
        .collect();
    Joined {
        classes,
        profile,
        tracking: set.tracking,
        there: kept,
        gone,
        published_at_ms: set.published_at_ms,
    }
}

/// The join as text: the census's text, then the top `limit` classes that have sampled
/// objects alive, each with its top `per_class` sites.
pub fn text(census: &Census, joined: &Joined, limit: usize, per_class: usize) -> String {
    let mut out = crate::census::render::text(census, limit);
    let p = &joined.profile;
    let age_s = (census.taken_at_ms.saturating_sub(joined.published_at_ms)) as f64 / 1000.0;
    let _ = writeln!(
        out,
        "\nallocation sites of live objects: {} sampled objects still in their slots, {} gone \
         since the tracker's last GC (sampling one per {} of allocation, {}; published {:.1} s \
         before the census)",
        joined.there,
        joined.gone,
        human_bytes(p.rate_bytes),
        if joined.tracking {
            format!("tracking for {:.0} s", p.duration_ns as f64 / 1e9)
        } else {
            "tracking stopped".to_string()
        },
        age_s
    );
    let _ = writeln!(
        out,
        "{:>12} {:>12}  class (type), then its sites: estimated objects, slot bytes, share \
         of the class's objects",
        "objects", "bytes"
    );
    let shown = joined.classes.iter().filter(|c| !c.sites.is_empty());
    for class in shown.take(limit) {
        let _ = writeln!(
            out,
            "{:>12} {:>12}  {} ({})",
            class.objects,
            human_bytes(class.bytes),
            row_name(&class.name, &class.type_name),
            class.type_name
        );
        for share in class.sites.iter().take(per_class) {
            let pct = 100.0 * share.objects as f64 / class.objects.max(1) as f64;
            let _ = writeln!(
                out,
                "{:>12} {:>12}  {:>5.1}%  {}",
                share.objects,
                human_bytes(share.bytes),
                pct,
                site_text(p, share.site)
            );
        }
        if class.sites.len() > per_class {
            let _ = writeln!(
                out,
                "{:>27}... {} more sites",
                "",
                class.sites.len() - per_class
            );
        }
    }
    for note in &p.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}

/// A site as its innermost frames: `String#* < Listener.leak (app.rb:12) < ...`.
fn site_text(profile: &AllocProfile, site: usize) -> String {
    let frames = &profile.sites[site].frames;
    let mut parts: Vec<String> = (frames.iter().take(3))
        .map(|&f| frame_text(&profile.frames[f as usize]))
        .collect();
    if frames.len() > 3 {
        parts.push("...".into());
    }
    parts.join(" < ")
}

/// What `rubyspy heap --by site` adds to a census: the join, or why there is none.
#[derive(Debug, Clone)]
pub enum Sites {
    Joined(Box<Joined>),
    Unavailable(String),
}

/// Reads the live set process `pid` publishes, checks which samples are still in their
/// slots, and joins them with `census` (just taken of the same process through `mem`).
pub fn read_sites<M: Memory>(pid: i32, mem: &M, census: &Census) -> Sites {
    let how = "allocation sites need tracking on in the process: RUBYSPY_ALLOCATIONS=1 in \
               its environment, or RubySpy.track_allocations in its code";
    let header = read_maps(pid)
        .ok()
        .and_then(|maps| find_extension_symbol(pid, &maps, published::SYMBOL));
    let Some(header) = header else {
        return Sites::Unavailable(format!("pid {pid} has not loaded rbspy_ext: {how}"));
    };
    match published::read(mem, header) {
        Ok(set) => {
            let there = published::still_there(mem, &set);
            Sites::Joined(Box::new(join(census, &set, &there)))
        }
        Err(Unpublished::Nothing) => Sites::Unavailable(format!(
            "pid {pid} has published no allocations: {how} (it publishes once a second while \
             tracking{})",
            if census.ruby_version.starts_with("2.7") {
                "; on Ruby 2.7 only when tracking stops"
            } else {
                ""
            }
        )),
        Err(Unpublished::Malformed(e)) | Err(Unpublished::Unreadable(e)) => Sites::Unavailable(
            format!("pid {pid}'s published allocations did not read: {e}"),
        ),
    }
}

/// A frame as the site list shows it: a C function by its label, Ruby code with its line.
fn frame_text(f: &crate::model::Frame) -> String {
    if f.c_function {
        f.label.to_string()
    } else {
        format!("{} ({}:{})", f.label, f.path, f.lineno)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocs::published::LiveSample;
    use crate::census::ClassRow;
    use crate::model::Frame;
    use std::sync::Arc;

    #[test]
    fn allocs_join_puts_samples_still_there_under_their_class() {
        let frame = |label: &str, line| Frame {
            label: Arc::from(label),
            base_label: Arc::from(label),
            path: Arc::from("app.rb"),
            absolute_path: None,
            lineno: line,
            c_function: false,
        };
        let site = |frame, class: &str, type_name: &str| SiteCounts {
            frames: vec![frame],
            class: class.into(),
            type_name: type_name.into(),
            samples: 5,
            ..SiteCounts::default()
        };
        let set = LiveSet {
            tracking: true,
            published_at_ms: 1_000,
            profile: AllocProfile {
                rate_bytes: 1,
                frames: vec![frame("leak", 3), frame("churn", 9)],
                sites: vec![site(0, "String", "T_STRING"), site(1, "String", "T_STRING")],
                ..AllocProfile::default()
            },
            site_classes: vec![(0x50, 5), (0x50, 5)],
            live: (0..5)
                .map(|i| LiveSample {
                    address: 0x1000 + 40 * i,
                    site: (i >= 3) as u32,
                    size: 40,
                    times: 1,
                    rate: 0,
                })
                .collect(),
        };
        let census = Census {
            taken_at_ms: 1_500,
            classes: vec![ClassRow {
                name: "String".into(),
                type_name: "T_STRING".into(),
                objects: 10,
                slot_bytes: 400,
                heap_bytes: 0,
            }],
            ..Census::default()
        };
        // The fifth (a churn sample) was freed since the tracker's last GC.
        let joined = join(&census, &set, &[true, true, true, true, false]);
        assert_eq!((joined.there, joined.gone), (4, 1));
        let sites = &joined.classes[0].sites;
        assert_eq!(
            sites
                .iter()
                .map(|s| (s.site, s.objects, s.bytes))
                .collect::<Vec<_>>(),
            vec![(0, 3, 120), (1, 1, 40)]
        );
        assert_eq!(joined.profile.sites[1].live_samples, 1);
        assert_eq!(joined.profile.sites[1].samples, 5, "allocated counts stay");
        let text = text(&census, &joined, 10, 5);
        assert!(text.contains("leak (app.rb:3)"), "{text}");
        assert!(text.contains("30.0%"), "{text}");

        // A sample that stands for 2^32 - 1 (a count a blob may claim) is counted at once,
        // not in 4 billion steps.
        let mut big = set.clone();
        big.live.truncate(1);
        big.live[0].times = u32::MAX;
        let joined = join(&census, &big, &[true]);
        let share = &joined.classes[0].sites[0];
        assert_eq!(share.samples, u64::from(u32::MAX));
        assert_eq!(share.objects, u64::from(u32::MAX));
        assert_eq!(share.bytes, 40 * u64::from(u32::MAX));
        assert_eq!(joined.profile.sites[0].live_samples, u64::from(u32::MAX));
    }
}
