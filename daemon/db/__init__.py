"""Request status tables: SQLAlchemy models, the store (batched writes, recovery), migrations."""
