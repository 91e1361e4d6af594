//! CPU backend (in progress)
