"""Helpers shared by the test folders (public: import them from here, never from another
test module)."""
