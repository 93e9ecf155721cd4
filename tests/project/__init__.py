"""The project as a whole: lint and types, and the documentation site."""
