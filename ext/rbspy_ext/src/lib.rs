//! The Ruby face of rbspy_ext: a thin magnus layer over `rbspy_ext_core`. Ruby-side API,
//! docs and the error classes live in lib/; this file only wires the native class.
use magnus::{Error, Ruby};

mod errors;
mod handle;
mod nogvl;
mod recorder;
mod state;

#[magnus::init]
fn init(ruby: &Ruby) -> Result<(), Error> {
    handle::init(ruby)?;
    state::init(ruby)?;
    recorder::init(ruby)
}
