//! Shared helpers of the test suite (in progress)
