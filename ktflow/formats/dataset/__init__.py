"""Training data: validate every record before training, and prepare what LlamaFactory reads.

LlamaFactory (0.9.5) checks records only while it tokenizes them, and then mostly by logging
"Skipping this abnormal example" and dropping the record: a typo in a role name costs a
training example silently, and a bad JSON line fails the run after the model has loaded.
:func:`validate_dataset` reads every record of every file up front and reports all the bad
ones at once, as ``file:line: reason``.

:func:`prepare_dataset` then writes a normalized copy of the data plus a ``dataset_info.json``
into one directory, so the SFT stage passes ``dataset: <name>`` and ``dataset_dir: <dir>``:

- alpaca: the records with canonical keys (instruction, input, output, system, history, tools,
  images), whatever keys the source used (``DatasetConfig.columns``);
- sharegpt: the conversations with the source's tags, plus system, tools and images columns;
- openai (OpenAI chat messages): LlamaFactory's sharegpt form with role/content tags; content
  parts are flattened to text, each image part becoming an ``<image>`` placeholder whose
  absolute path goes to the ``images`` column;
- template ``empty`` (the Kimi-K2.5 KT recipe): each conversation rendered with the model's own
  chat template into an alpaca prompt/response pair.

Every optional column is always written (``""`` or ``[]`` when a record has none), so the
``dataset_info.json`` entry depends on the config alone and :func:`dataset_digest` can compute
the stage's cache key from the files' bytes without parsing them.

The copy is one JSON *array* file, not JSON Lines, on purpose: the ``datasets`` JSON loader
infers the schema of JSON Lines from the first 10 MB only, so a list column that is empty
there (no record with images or history yet) is typed ``list<null>`` and the first later
record that has one fails the whole load ("Couldn't cast array of type list<item: string> to
null"). A JSON array is read whole, and its schema inferred over every record.

The modules: ``alpaca``, ``sharegpt`` and ``openai`` normalize a record of their dialect;
``reader`` checks the config, reads the files and validates every record; ``prepare`` computes
the digest and publishes the normalized copy; ``_common`` holds the constants and checks they
share. Every name is importable from ``ktflow.formats.dataset``.
"""

from __future__ import annotations

from ktflow.formats.dataset._common import (
    _EMPTY_TEMPLATE_COLUMNS,
    _OPENAI_ENTRY_COLUMNS,
    _TOOL_RESPONSE_JOIN,
    DATASET_INFO,
    IMAGE_PLACEHOLDER,
    LAYOUT_VERSION,
    MAX_SHOWN,
    OPENAI_ROLES,
    OPENAI_TAGS,
    SHAREGPT_TAGS,
    SOURCE_COLUMNS,
    STAGE_NAME,
    SUPPORTED_SUFFIXES,
    BadRecord,
    _alternation,
    _Bad,
    _check_placeholders,
    _get_str,
    _images,
    _json_type,
    _Located,
    _messages_list,
    _Normalized,
    _resolve_image,
    _sharegpt_tags,
    _source_columns,
    _tools,
)
from ktflow.formats.dataset.alpaca import (
    _normalize_alpaca,
)
from ktflow.formats.dataset.openai import (
    _arguments,
    _check_openai_turns,
    _check_tool_calls,
    _flatten_content,
    _normalize_openai,
    _openai_message,
    _Parsed,
    _sharegpt_turns,
)
from ktflow.formats.dataset.prepare import (
    PreparedDataset,
    _chat_template_identity,
    _ChatRenderer,
    _dataset_manifest,
    _digest,
    _existing_artifact,
    _file_hashes,
    _final_record,
    _require_model_dir,
    _write_records,
    dataset_digest,
    dataset_entry,
    prepare_dataset,
)
from ktflow.formats.dataset.reader import (
    _bad_records_error,
    _check_config,
    _first_byte,
    _good_records,
    _is_single_object,
    _iter_file,
    _normalized_records,
    record_messages,
    user_prompts,
    validate_dataset,
)
from ktflow.formats.dataset.sharegpt import (
    _normalize_sharegpt,
    _parse_function_call,
)

__all__ = [
    "BadRecord",
    "DATASET_INFO",
    "IMAGE_PLACEHOLDER",
    "LAYOUT_VERSION",
    "MAX_SHOWN",
    "OPENAI_ROLES",
    "OPENAI_TAGS",
    "PreparedDataset",
    "SHAREGPT_TAGS",
    "SOURCE_COLUMNS",
    "STAGE_NAME",
    "SUPPORTED_SUFFIXES",
    "_Bad",
    "_ChatRenderer",
    "_EMPTY_TEMPLATE_COLUMNS",
    "_Located",
    "_Normalized",
    "_OPENAI_ENTRY_COLUMNS",
    "_Parsed",
    "_TOOL_RESPONSE_JOIN",
    "_alternation",
    "_arguments",
    "_bad_records_error",
    "_chat_template_identity",
    "_check_config",
    "_check_openai_turns",
    "_check_placeholders",
    "_check_tool_calls",
    "_dataset_manifest",
    "_digest",
    "_existing_artifact",
    "_file_hashes",
    "_final_record",
    "_first_byte",
    "_flatten_content",
    "_get_str",
    "_good_records",
    "_images",
    "_is_single_object",
    "_iter_file",
    "_json_type",
    "_messages_list",
    "_normalize_alpaca",
    "_normalize_openai",
    "_normalize_sharegpt",
    "_normalized_records",
    "_openai_message",
    "_parse_function_call",
    "_require_model_dir",
    "_resolve_image",
    "_sharegpt_tags",
    "_sharegpt_turns",
    "_source_columns",
    "_tools",
    "_write_records",
    "dataset_digest",
    "dataset_entry",
    "prepare_dataset",
    "record_messages",
    "user_prompts",
    "validate_dataset",
]
