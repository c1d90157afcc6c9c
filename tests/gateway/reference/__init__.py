"""Reference models of what the native front does, for the property tests to hold it to."""
