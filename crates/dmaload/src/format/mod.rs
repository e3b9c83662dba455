//! File formats whose layout the loader understands, so that a loaded
//! buffer can be handed out as typed views without copying.
//!
//! Every parser here treats its input as untrusted: malformed input is an
//! error that says what is wrong, never a panic, a hang or an allocation
//! much larger than the input.

pub mod model;
pub mod safetensors;
