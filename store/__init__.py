"""The shared store: index version files, FAISS helpers, the item store (app and
index_builder read and write it; it imports only models-free libraries)."""
