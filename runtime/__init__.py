"""What generated programs import. Runs without the compiler: depends only on torch."""
