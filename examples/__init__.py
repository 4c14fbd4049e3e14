"""Examples that use the project from outside the `pace` package."""
