//! Sampled allocations: where the objects a process allocates come from, and which of them are
//! still alive, as the extension's tracker (ext/rbspy_ext/src/allocs.rs) counts them in the
//! process itself. This is the model and its forms; the tracker hands over one [`SiteCounts`]
//! per allocation site (a stack, a class and a type) and [`AllocProfile::new`] makes the rest.
//!
//! Sampling is by bytes, as Go's heap profiler samples: the tracker draws the bytes until the
//! next sample from an exponential distribution whose mean is the rate (`rate_bytes`), and
//! takes the object whose slot crosses it. An object of `s` bytes is then sampled with
//! probability `1 - exp(-s / rate)`, and each sample stands for `1 / (1 - exp(-s / rate))`
//! objects ([`weight`]): the estimates below are already scaled, as Go's profiles are, since
//! `go tool pprof` does not scale by the period. A rate of 1 byte samples every allocation,
//! with a weight of exactly 1 (a slot holds 40 bytes at least).
//!
//! Why bytes, not objects: Go's tools and fleet backends read `space`/`bytes` periods, and a
//! larger object (a bigger slot from Ruby 3.2's variable-width allocation) is likelier to be
//! sampled, in proportion to the memory it takes. The bytes are the object's slot, known when
//! it is allocated; what it allocates outside the heap later (a long String's buffer) is not.
pub mod arm;
pub mod budget;
pub mod gate;
pub mod hold;
pub mod live;
pub mod marks;
pub mod points;
pub mod pprof;
pub mod published;
pub mod view;

use crate::model::Frame;

/// The weight of one sampled object of `size` bytes at a rate of `rate_bytes`: the number of
/// objects of its size that one sample stands for.
pub fn weight(size: u64, rate_bytes: u64) -> f64 {
    if rate_bytes <= 1 {
        return 1.0;
    }
    let p = -(-(size.max(1) as f64) / rate_bytes as f64).exp_m1();
    if p > 0.0 {
        1.0 / p
    } else {
        rate_bytes as f64
    }
}

/// What the tracker counted at one allocation site: its samples, and of them those still
/// alive, each with their bytes and their summed [`weight`]s. Serialized as the published
/// blob's site fields (published.rs).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SiteCounts {
    /// Indexes into [`AllocProfile::frames`], innermost first.
    pub frames: Vec<u32>,
    /// The object's class as Ruby names it (`String`, `Foo::Bar`); "" when it has none a
    /// program could see (a hidden object).
    pub class: String,
    /// Its type (`T_STRING`, `T_OBJECT`...).
    pub type_name: String,
    pub samples: u64,
    pub sampled_bytes: u64,
    pub weight: f64,
    pub weighted_bytes: f64,
    pub live_samples: u64,
    pub live_bytes: u64,
    pub live_weight: f64,
    pub live_weighted_bytes: f64,
}

impl SiteCounts {
    /// Counts one more sampled object of `size` bytes.
    pub fn add(&mut self, size: u64, rate_bytes: u64) {
        let w = weight(size, rate_bytes);
        self.samples += 1;
        self.sampled_bytes += size;
        self.weight += w;
        self.weighted_bytes += w * size as f64;
        self.add_live_weighted(size, w, 1);
    }

    /// Counts `n` more sampled objects of `size` bytes as alive only (a live set read from
    /// outside recounts what is alive; what was allocated stays the tracker's count). At
    /// once, not `n` times: `n` is a count a published blob gives, up to 2^32.
    pub fn add_live(&mut self, size: u64, rate_bytes: u64, n: u64) {
        self.add_live_weighted(size, weight(size, rate_bytes), n);
    }

    fn add_live_weighted(&mut self, size: u64, w: f64, n: u64) {
        self.live_samples = self.live_samples.saturating_add(n);
        self.live_bytes = self.live_bytes.saturating_add(size.saturating_mul(n));
        self.live_weight += w * n as f64;
        self.live_weighted_bytes += w * size as f64 * n as f64;
    }

    /// Counts nothing as alive (before the live ones are counted again).
    pub fn clear_live(&mut self) {
        self.live_samples = 0;
        self.live_bytes = 0;
        self.live_weight = 0.0;
        self.live_weighted_bytes = 0.0;
    }

    /// Takes one sampled object of `size` bytes out of the live ones (the GC freed it).
    pub fn free(&mut self, size: u64, rate_bytes: u64) {
        if self.live_samples == 0 {
            return;
        }
        let w = weight(size, rate_bytes);
        self.live_samples -= 1;
        self.live_bytes = self.live_bytes.saturating_sub(size);
        if self.live_samples == 0 {
            // Sums of floats drift: a site with nothing alive has exactly nothing alive.
            self.live_weight = 0.0;
            self.live_weighted_bytes = 0.0;
        } else {
            self.live_weight = (self.live_weight - w).max(0.0);
            self.live_weighted_bytes = (self.live_weighted_bytes - w * size as f64).max(0.0);
        }
    }
}

/// The estimates of one site: objects and bytes allocated, and still alive (`inuse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Estimates {
    pub alloc_objects: u64,
    pub alloc_space: u64,
    pub inuse_objects: u64,
    pub inuse_space: u64,
}

impl SiteCounts {
    pub fn estimates(&self) -> Estimates {
        Estimates {
            alloc_objects: self.weight.round() as u64,
            alloc_space: self.weighted_bytes.round() as u64,
            inuse_objects: self.live_weight.round() as u64,
            inuse_space: self.live_weighted_bytes.round() as u64,
        }
    }
}

/// A recording of sampled allocations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocProfile {
    pub pid: i32,
    pub ruby_version: String,
    /// Mean bytes between samples; 1: every allocation.
    pub rate_bytes: u64,
    /// When tracking started (Unix epoch, ns), and how long it has run.
    pub start_unix_ns: u64,
    pub duration_ns: u64,
    pub frames: Vec<Frame>,
    pub sites: Vec<SiteCounts>,
    /// What the user should know (samples not kept past a bound, Ractors not seen...).
    pub notes: Vec<String>,
}

/// The one frame of a site whose stack is empty: an allocation Ruby makes before any frame
/// of its thread exists (on 3.1, a new Thread's first Array, before its block runs). Named,
/// so that views and Go's tools show a stack, not a bare class.
pub const NO_RUBY_FRAME: &str = "(no Ruby frame)";

impl AllocProfile {
    /// This profile, with every site whose stack is empty given the one frame
    /// [`NO_RUBY_FRAME`] (borrowed as it is when there is none).
    pub fn frameless_named(&self) -> std::borrow::Cow<'_, AllocProfile> {
        if self.sites.iter().all(|s| !s.frames.is_empty()) {
            return std::borrow::Cow::Borrowed(self);
        }
        let mut named = self.clone();
        let id = named.frames.len() as u32;
        named
            .frames
            .push(crate::profile::frame(NO_RUBY_FRAME, "", 0, true));
        for site in named.sites.iter_mut().filter(|s| s.frames.is_empty()) {
            site.frames.push(id);
        }
        std::borrow::Cow::Owned(named)
    }

    /// The sites' estimates summed: what the whole process allocated and keeps.
    pub fn totals(&self) -> Estimates {
        self.sites
            .iter()
            .map(SiteCounts::estimates)
            .fold(Estimates::default(), |a, e| Estimates {
                alloc_objects: a.alloc_objects + e.alloc_objects,
                alloc_space: a.alloc_space + e.alloc_space,
                inuse_objects: a.inuse_objects + e.inuse_objects,
                inuse_space: a.inuse_space + e.inuse_space,
            })
    }

    /// Every frame index in range (the writers index frames directly).
    pub fn check(&self) -> Result<(), String> {
        for (i, s) in self.sites.iter().enumerate() {
            if let Some(f) = s.frames.iter().find(|&&f| f as usize >= self.frames.len()) {
                return Err(format!("site {i} names frame {f} of {}", self.frames.len()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_with_no_frame_is_named() {
        let site = |frames: Vec<u32>| SiteCounts {
            frames,
            class: "Array".into(),
            type_name: "T_ARRAY".into(),
            ..SiteCounts::default()
        };
        let mut p = AllocProfile {
            frames: vec![crate::profile::frame("Object#work", "a.rb", 3, false)],
            sites: vec![site(vec![0]), site(vec![])],
            ..AllocProfile::default()
        };
        let named = p.frameless_named();
        assert_eq!(named.sites[0].frames, vec![0]);
        assert_eq!(named.sites[1].frames, vec![1]);
        assert_eq!(&*named.frames[1].label, NO_RUBY_FRAME);
        assert!(named.check().is_ok());
        p.sites.pop();
        assert!(matches!(p.frameless_named(), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn allocs_weight_is_one_at_rate_one_and_about_rate_over_size_when_sparse() {
        assert_eq!(weight(40, 1), 1.0);
        assert_eq!(weight(40, 0), 1.0);
        let w = weight(40, 512 * 1024);
        assert!((w - 512.0 * 1024.0 / 40.0).abs() < 1.0, "{w}");
        // A slot as large as the rate is sampled 63 % of the time: 1.58 objects a sample.
        assert!((weight(1000, 1000) - 1.0 / (1.0 - (-1.0f64).exp())).abs() < 1e-9);
    }

    #[test]
    fn allocs_site_counts_follow_frees_down_to_nothing() {
        let mut s = SiteCounts::default();
        for _ in 0..3 {
            s.add(40, 1);
        }
        s.free(40, 1);
        let e = s.estimates();
        assert_eq!(
            (
                e.alloc_objects,
                e.alloc_space,
                e.inuse_objects,
                e.inuse_space
            ),
            (3, 120, 2, 80)
        );
        s.free(40, 1);
        s.free(40, 1);
        s.free(40, 1); // one more free than alive: ignored
        let e = s.estimates();
        assert_eq!((e.inuse_objects, e.inuse_space, e.alloc_objects), (0, 0, 3));
        let mut sparse = SiteCounts::default();
        sparse.add(40, 4000);
        sparse.free(40, 4000);
        assert_eq!(sparse.live_weight, 0.0);
        assert_eq!(
            sparse.estimates().alloc_objects,
            weight(40, 4000).round() as u64
        );
    }
}
