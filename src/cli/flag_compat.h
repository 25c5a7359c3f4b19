// The flags of ms-swift (`swift sft`, `megatron sft`), Megatron-LM and transformers' TrainingArguments
// that a user brings to `deltamoe train` / `deltamoe data`, and what deltamoe does with each: the
// same meaning under another name (alias), nothing to do here (noted), or a refusal with the reason
// and the deltamoe way. docs/swift_compat.md prints the table.
#pragma once

#include <string>
#include <vector>

#include "cli/args.h"

namespace deltamoe {

// Registers the table's entries on parser (a command's own flag of the same name wins); aliases are
// registered only where their target is one of the command's flags.
void add_foreign_flags(ArgParser& parser);

// The whole table (for docs and tests).
const std::vector<ForeignFlag>& foreign_flag_table();

}  // namespace deltamoe
