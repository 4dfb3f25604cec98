from .deberta import deberta_from_hf
