/* log2 e and ln 2, for every backend: scores are kept in log2 units (the
 * scale, softcap and ALiBi slope carry log2 e), so exponentials are exp2 and
 * lse = m ln 2 + log l. */
#ifndef FA_COMMON_LOG2_H
#define FA_COMMON_LOG2_H

#define FA_LOG2E 1.44269504088896341f
#define FA_LN2 0.693147180559945309f

#endif
