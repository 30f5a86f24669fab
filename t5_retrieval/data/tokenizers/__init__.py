"""Token ids for queries and passages: the sentencepiece (T5) and WordPiece (BERT) vocabularies and their conventions."""
