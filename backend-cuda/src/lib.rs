//! cuda backend (in progress)
